"""The windows the growth rules judge by: each layer's last samples of one signal, the medians of
the window before (``AlertRules.window`` samples) and of the last one, and the lowest and highest
median a window before ever had (:class:`Trend`). Shared by
:class:`~layerwatch.health.rules.update_shape.UpdateShape`,
:class:`~layerwatch.health.rules.probe_trends.ProbeTrends` and the routers' rules
(:class:`~layerwatch.health.rules.router_windows.RouterWindows`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np


class Trend(NamedTuple):
    """A layer's signal at a sample, once its windows are full: the medians of the window before
    and of the last one (``now``), and the lowest and highest median a window before had."""

    before: float
    now: float
    lowest: float
    highest: float

    def grew(self, factor: float) -> bool:
        """The last window's median at least ``factor`` times the lowest before it, a positive one."""
        return self.now >= factor * self.lowest > 0

    def rose(self, by: float) -> bool:
        """The last window's median at least ``by`` above the lowest before it (a signal in
        logarithms, such as nats: a growth is a difference)."""
        return self.now - self.lowest >= by

    def fell(self, share: float) -> bool:
        """The last window's median below ``share`` of the highest before it."""
        return self.now < share * self.highest


class Windows:
    """Each layer's last ``window + recent`` values of one signal: the medians of the ``window``
    before and of the last ``recent`` (``window`` unless told), and the lowest and highest median
    a window before ever had. A short last window tells a change sooner: the median of 3 moves
    at the second sample of a change, and one odd sample does not move it."""

    def __init__(self, window: int, recent: Optional[int] = None) -> None:
        self.window = window
        self.recent = window if recent is None else recent
        self._values: dict[str, list[float]] = {}
        self._extremes: dict[str, tuple[float, float]] = {}
        self._restarted: set[str] = set()  # layers whose extremes start again from their last window
        self._since: dict[str, int] = {}  # samples since a layer's restart, while its windows before reach past it

    def restart(self) -> None:
        """Judge growth from here on (the loss made progress): each layer's extremes become the
        median of the window that ends at its next sample, and the windows before it are not
        folded in until they lie after that window's start."""
        self._restarted.update(self._values)

    def add(self, layer: str, value: float) -> Optional[Trend]:
        """``value`` at this sample; once both windows are full, their :class:`Trend`."""
        if not np.isfinite(value):
            return None
        values = self._values.setdefault(layer, [])
        values.append(value)
        del values[:-(self.window + self.recent)]
        if len(values) < self.window + self.recent:
            return None
        before, now = float(np.median(values[:self.window])), float(np.median(values[self.window:]))
        if layer in self._restarted:  # from the window that ends at the restart
            self._restarted.discard(layer)
            self._extremes[layer], self._since[layer] = (now, now), 0
        since = self._since.get(layer)
        if since is not None and since < self.window:  # the window before began before the restart
            self._since[layer] = since + 1
            lowest, highest = self._extremes[layer]
            return Trend(before, now, lowest, highest)
        self._since.pop(layer, None)
        lowest, highest = self._extremes.get(layer, (before, before))
        self._extremes[layer] = lowest, highest = min(lowest, before), max(highest, before)
        return Trend(before, now, lowest, highest)
