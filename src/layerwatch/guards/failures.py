"""The one failure policy of a run: whatever fails is warned about once and skipped.

An inspector never raises into the training loop and never stops it: a probe, a reduction
or a write that fails is named in one ``RuntimeWarning`` (the first time that kind of
failure happens) and left out; training goes on unchanged.

Every warning of a run goes through :meth:`FailurePolicy.warn` (and every line of news through
:meth:`FailurePolicy.say`), which points it at the
user's own line (the first frame outside layerwatch and the frameworks that call it), and
prints it inside ``around_warning``: a front door gives one (:meth:`FailurePolicy.pause_with`) to pause a progress bar.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Callable, ContextManager, Optional, TypeVar

# Packages whose frames stand between a warning and the user's line; looked up when warning,
# so none of them is imported for it.
_FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")


def _internal_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.dirname(__file__))]  # the package, from guards/
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(path))
    return tuple(d + os.sep for d in dirs)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that names the
    first frame outside layerwatch, torch and the training frameworks."""
    internal = _internal_dirs()
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level

T = TypeVar("T")


class FailurePolicy:
    def __init__(self) -> None:
        self._warned: set[str] = set()
        self.around_warning: Callable[[], ContextManager[object]] = contextlib.nullcontext

    def pause_with(self, around: Callable[[], ContextManager[object]]) -> None:
        """Say every warning and line inside ``around()`` (a front door's: a progress bar paused)."""
        self.around_warning = around

    def warn(self, message: str) -> None:
        """A ``RuntimeWarning`` pointing at the user's line."""
        with self.around_warning():
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())

    def say(self, message: str) -> None:
        """One plain line on stderr (and an INFO record of the ``layerwatch`` logger) for news
        that is not a fault, such as the sampling interval the overhead budget chose."""
        logging.getLogger("layerwatch").info("%s", message)
        with self.around_warning():
            print(message, file=sys.stderr, flush=True)

    def warn_once(self, key: str, message: str) -> None:
        """Warn with ``message`` the first time ``key`` comes up."""
        if key not in self._warned:
            self._warned.add(key)
            self.warn(message)

    def say_once(self, key: str, message: str) -> None:
        """:meth:`say` ``message`` the first time ``key`` comes up."""
        if key not in self._warned:
            self._warned.add(key)
            self.say(message)

    def run(self, what: str, action: Callable[[], T], step: int, otherwise: Optional[T] = None) -> Optional[T]:
        """``action``'s value; on an exception, warned once (``could not <what>``), ``otherwise``."""
        try:
            return action()
        except Exception as e:  # an inspector must never break the training run
            self.failed(what, e, step)
            return otherwise

    def failed(self, what: str, error: Exception, step: int) -> None:
        """``error`` stopped ``what`` at ``step``: warned once (``could not <what>``), as :meth:`run`
        does, for a path run every step that catches it itself (no closure to make a step)."""
        self.warn_once(f"fail:{what}", f"layerwatch: could not {what} at step {step}: {error!r}; skipped")
