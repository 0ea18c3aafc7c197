"""The windows the growth rules judge by: each layer's last ``2 * window`` samples of one signal,
the medians of the window before and of the last one, and the lowest and highest median a
window before ever had (``AlertRules.window``). Shared by
:class:`~layerwatch.health.rules.update_shape.UpdateShape` and
:class:`~layerwatch.health.rules.probe_trends.ProbeTrends`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


class Windows:
    """Each layer's last ``2 * window`` values of one signal: the medians of the window before
    and of the last one, and the lowest and highest median a window before ever had."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._values: dict[str, list[float]] = {}
        self._extremes: dict[str, tuple[float, float]] = {}
        self._restarted: set[str] = set()  # layers whose extremes start again from their last window
        self._since: dict[str, int] = {}  # samples since a layer's restart, while its windows before reach past it

    def restart(self) -> None:
        """Judge growth from here on (the loss made progress): each layer's extremes become the
        median of the window that ends at its next sample, and the windows before it are not
        folded in until they lie after that window's start."""
        self._restarted.update(self._values)

    def add(self, layer: str, value: float) -> Optional[tuple[float, float, float, float]]:
        """``value`` at this sample; once two windows are full, ``(before, now, lowest, highest)``."""
        if not np.isfinite(value):
            return None
        values = self._values.setdefault(layer, [])
        values.append(value)
        del values[:-2 * self.window]
        if len(values) < 2 * self.window:
            return None
        before, now = float(np.median(values[:self.window])), float(np.median(values[self.window:]))
        if layer in self._restarted:  # from the window that ends at the restart
            self._restarted.discard(layer)
            self._extremes[layer], self._since[layer] = (now, now), 0
        since = self._since.get(layer)
        if since is not None and since < self.window:  # the window before began before the restart
            self._since[layer] = since + 1
            lowest, highest = self._extremes[layer]
            return before, now, lowest, highest
        self._since.pop(layer, None)
        lowest, highest = self._extremes.get(layer, (before, before))
        self._extremes[layer] = lowest, highest = min(lowest, before), max(highest, before)
        return before, now, lowest, highest
