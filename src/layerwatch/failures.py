"""The one failure policy of a run: whatever fails is warned about once and skipped.

An inspector never raises into the training loop and never stops it: a probe, a reduction
or a write that fails is named in one ``RuntimeWarning`` (the first time that kind of
failure happens) and left out; training goes on unchanged.
"""

from __future__ import annotations

import warnings
from typing import Callable


class FailurePolicy:
    def __init__(self) -> None:
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str) -> None:
        """Warn with ``message`` the first time ``key`` comes up."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def run(self, what: str, action: Callable[[], object], step: int) -> bool:
        """Run ``action``; on an exception warn once (``could not <what>``) and return False."""
        try:
            action()
        except Exception as e:  # an inspector must never break the training run
            self.warn_once(f"fail:{what}", f"layerwatch: could not {what} at step {step}: {e!r}; skipped")
            return False
        return True
