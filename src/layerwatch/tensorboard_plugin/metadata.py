"""What the LAYERWATCH tab's data is, and how to read it back (no torch: TensorBoard loads this).
Its names are :mod:`layerwatch.vocabulary`'s.

Written by :mod:`layerwatch.sinks.plugin_data`; each sampled step has, as tensors owned by
the ``layerwatch`` plugin:

- ``layerwatch/series/<series>``: float32 ``[n]``, one value per layer of the series' names
  in the layout, for each per-layer series of the step (``grads_norm``, ``fwd_ms``,
  ``activation_bytes``, ...: the scalar tag's prefix before its ``/``); -inf for a layer not
  measured at that step (a module not called, a parameter without a gradient);
- ``layerwatch/layout``: a JSON string ``{"series": {series: [layer names]}}``, in the same
  event as the first step's series, and again when a series meets a layer it had not seen (the
  lists only grow, so a layer that comes and goes does not rewrite them);
- ``layerwatch/events/<kind>``: a JSON string at the step where it appears, for the kinds
  ``alerts`` (the new alerts, a list); ``first_offender`` (``layer``, ``step``, ``phase``,
  ``text``, and ``replayed_from``: the step whose batch was run again to find it, or null);
  ``first_nonfinite_step``; and ``spikes`` (the loss spikes found since the sample before, a
  list: ``step``, ``what``, ``value``, ``z``, ``mean``, ``std``, ``scale`` (``"log"``: ``z``
  and ``std`` of the logarithm, ``mean`` the geometric mean; ``"linear"``), ``over``, ``layer`` (the
  top-ranked), ``layers`` (ranked: ``layer``, ``what``, ``factor``, ``before``, ``now``),
  ``sampled_at``, ``replayed``, ``text``, ``message``); and ``rerun`` (``true``: the step's
  per-module values are of a compiled model's eager re-run): one tag each, as a step may have
  several and a time series keeps one value per step.
"""

from __future__ import annotations

import bisect
import json
from typing import Any

import numpy as np

from layerwatch.reading.rankings import Table
from layerwatch.vocabulary import EVENTS, LAYOUT, SERIES



def decode_text(value: Any) -> Any:
    """A ``layout`` or ``events`` tensor (a NumPy array from the data provider, or a
    ``TensorProto``) as the JSON it holds."""
    if hasattr(value, "tensor_content"):
        raw = value.string_val[0]
    else:
        raw = np.asarray(value).item()
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def decode_floats(value: Any) -> np.ndarray:
    """A ``series`` tensor (NumPy array or ``TensorProto``) as a float32 array."""
    if hasattr(value, "tensor_content"):
        return np.frombuffer(value.tensor_content, dtype="<f4")
    return np.asarray(value, dtype=np.float32).reshape(-1)


def decode(tag: str, value: Any) -> Any:
    """One of the tab's tensors as the Reader takes it: JSON for layouts and events, a float32
    array for series."""
    return decode_floats(value) if tag.startswith(SERIES) else decode_text(value)


class Reader:
    """Reassembles steps from the tab's tensors: feed it ``(step, wall_time, tag, value)`` in
    any order with :meth:`add` (values decoded by :func:`decode`), then read :meth:`series`.

    A step's values are read with the last layout written before them (by wall time, so a run
    resumed into the same directory, writing steps again, reads each step with its own
    layout). A step written twice keeps its later values.
    """

    def __init__(self) -> None:
        self._layouts: list[tuple[float, dict[str, list[str]]]] = []
        self._values: dict[str, dict[int, tuple[float, np.ndarray]]] = {}
        self.events: list[tuple[int, dict[str, Any]]] = []

    def add(self, step: int, wall_time: float, tag: str, value: Any) -> None:
        if tag == LAYOUT:
            self._layouts.append((wall_time, value["series"]))
        elif tag.startswith(EVENTS):
            self.events.append((step, {tag[len(EVENTS) :]: value}))
        elif tag.startswith(SERIES):
            by_step = self._values.setdefault(tag[len(SERIES) :], {})
            if step not in by_step or by_step[step][0] <= wall_time:
                by_step[step] = (wall_time, value)

    def add_tensor(self, step: int, wall_time: float, tag: str, tensor: Any) -> None:
        """:meth:`add` of a tensor as written (a ``TensorProto`` or NumPy array)."""
        self.add(step, wall_time, tag, decode(tag, tensor))

    def layout_sizes(self) -> dict[str, int]:
        """Each series' number of layers in the latest layout."""
        return {key: len(names) for key, names in self._latest_layout().items()}

    def _latest_layout(self) -> dict[str, list[str]]:
        return max(self._layouts, key=lambda item: item[0])[1] if self._layouts else {}

    def keys(self) -> list[str]:
        return list(self._values)

    def steps(self) -> list[int]:
        return sorted({step for by_step in self._values.values() for step in by_step})

    def series(self, key: str) -> dict[int, tuple[list[str], np.ndarray]]:
        """``{step: (names, values)}`` of one series; a step whose layout is missing (a
        damaged or down-sampled log) or does not match its values is left out. A value of
        -inf: that layer was not measured at that step."""
        layouts = sorted(self._layouts, key=lambda item: item[0])
        walls = [wall for wall, _ in layouts]
        out = {}
        for step, (wall, values) in sorted(self._values.get(key, {}).items()):
            at = bisect.bisect_right(walls, wall) - 1
            names = layouts[at][1].get(key) if at >= 0 else None
            if names is not None and len(names) == values.size:
                out[step] = (names, values)
        return out

    def matrix(self, key: str) -> tuple[list[str], list[int], np.ndarray]:
        """One series as layers x steps (float32; -inf where a layer has no value at a step,
        NaN where its statistic was NaN), layers in the order of the latest layout."""
        series = self.series(key)
        steps = sorted(series)
        rows: dict[str, int] = {}
        seen: set[int] = set()  # the steps of one layout share its list of names
        for names in [self._latest_layout().get(key, []), *(names for names, _ in series.values())]:
            if id(names) not in seen:
                seen.add(id(names))
                for name in names:
                    rows.setdefault(name, len(rows))
        matrix = np.full((len(rows), len(steps)), -np.inf, dtype="<f4")
        index_of: dict[int, np.ndarray] = {}  # one index array per distinct names list
        for column, step in enumerate(steps):
            names, values = series[step]
            index = index_of.get(id(names))
            if index is None:
                index = index_of[id(names)] = np.array([rows[name] for name in names], dtype=np.int64)
            matrix[index, column] = values
        return list(rows), steps, matrix

    def table(self, key: str) -> Table:
        """One series as a :class:`~layerwatch.reading.rankings.Table` (NaN: no finite value)."""
        names, steps, matrix = self.matrix(key)
        values = matrix.astype(np.float64)  # a factor of two float32 norms can pass float32's range
        return Table(names, np.asarray(steps, dtype=np.int64), np.where(np.isfinite(values), values, np.nan))
