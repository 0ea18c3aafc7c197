"""What the LAYERWATCH tab's data is, and how to read it back (no torch: TensorBoard loads this).

Written by :mod:`layerwatch.sinks.plugin_data`; each sampled step has, as tensors owned by
the ``layerwatch`` plugin:

- ``layerwatch/series/<series>``: float32 ``[n]``, one value per layer, for each per-layer
  series of the step (``grads_norm``, ``fwd_ms``, ``activation_bytes``, ...: the scalar tag's
  prefix before its ``/``), in the order of the series' names in the layout;
- ``layerwatch/layout``: a JSON string ``{"series": {series: [layer names]}}``, written at the
  first step and again at any step whose names differ from the last layout written;
- ``layerwatch/events/<kind>``: a JSON string at the step where it appears, for the kinds
  ``alerts`` (the new alerts, a list), ``first_offender`` and ``first_nonfinite_step``: one
  tag each, as a step may have several and a time series keeps one value per step.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from layerwatch.rankings import Table

PLUGIN_NAME = "layerwatch"
SERIES = "layerwatch/series/"  # the prefix of the series tags
LAYOUT = "layerwatch/layout"
EVENTS = "layerwatch/events/"  # the prefix of the event tags




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


class Reader:
    """Reassembles steps from the tab's tensors: feed it ``(step, tag, value)`` in any order
    with :meth:`add`, then read :meth:`series` (layouts apply to their own step and after)."""

    def __init__(self) -> None:
        self._layouts: list[tuple[int, dict[str, list[str]]]] = []
        self._values: dict[str, dict[int, np.ndarray]] = {}
        self.events: list[tuple[int, dict[str, Any]]] = []

    def add(self, step: int, tag: str, value: Any) -> None:
        if tag == LAYOUT:
            self._layouts.append((step, decode_text(value)["series"]))
        elif tag.startswith(EVENTS):
            self.events.append((step, {tag[len(EVENTS) :]: decode_text(value)}))
        elif tag.startswith(SERIES):
            self._values.setdefault(tag[len(SERIES) :], {})[step] = decode_floats(value)

    def layout_sizes(self) -> dict[str, int]:
        """Each series' number of layers in the latest layout."""
        if not self._layouts:
            return {}
        latest = max(self._layouts, key=lambda item: item[0])[1]
        return {key: len(names) for key, names in latest.items()}

    def keys(self) -> list[str]:
        return list(self._values)

    def steps(self) -> list[int]:
        return sorted({step for by_step in self._values.values() for step in by_step})

    def series(self, key: str) -> dict[int, tuple[list[str], np.ndarray]]:
        """``{step: (names, values)}`` of one series; a step whose layout is missing (a
        damaged or down-sampled log) or does not match its values is left out."""
        layouts = sorted(self._layouts, key=lambda item: item[0])
        layout_steps = [step for step, _ in layouts]
        out = {}
        for step, values in sorted(self._values.get(key, {}).items()):
            at = int(np.searchsorted(layout_steps, step, side="right")) - 1
            names = layouts[at][1].get(key) if at >= 0 else None
            if names is not None and len(names) == values.size:
                out[step] = (names, values)
        return out

    def matrix(self, key: str) -> tuple[list[str], list[int], np.ndarray]:
        """One series as layers x steps (float32; -inf where a layer has no value at a step,
        NaN where its statistic was NaN), layers in order of first appearance."""
        series = self.series(key)
        steps = sorted(series)
        rows: dict[str, int] = {}
        for names, _ in series.values():
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
        """One series as a :class:`~layerwatch.rankings.Table` (NaN: no finite value)."""
        names, steps, matrix = self.matrix(key)
        return Table(names, np.asarray(steps, dtype=np.int64), np.where(np.isfinite(matrix), matrix, np.nan))
