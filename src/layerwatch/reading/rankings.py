"""Which layers stand out over a run: the slowest, the largest memory, the fastest-changing
norms. One answer for ``layerwatch report`` and the LAYERWATCH tab (no torch here).

The input is a :class:`Table` per series (``fwd_ms``, ``grads_norm``, ...): layers x sampled
steps, NaN where a layer has no finite value at a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from layerwatch.vocabulary import ROOT

TOP = 5


@dataclass
class Table:
    """One series over a run: ``values[i, j]`` is layer ``names[i]`` at ``steps[j]``."""

    names: list[str]
    steps: np.ndarray
    values: np.ndarray

    @classmethod
    def from_points(cls, points: dict[str, list[tuple[int, float]]]) -> "Table":
        """From ``{layer: [(step, value), ...]}``."""
        names = list(points)
        steps = np.array(sorted({step for series in points.values() for step, _ in series}), dtype=np.int64)
        values = np.full((len(names), len(steps)), np.nan)
        for i, series in enumerate(points.values()):
            if series:
                at, vals = zip(*series)
                values[i, np.searchsorted(steps, at)] = vals
        return cls(names, steps, values)


def top_by_median(tables: Sequence[Table], unit: str, top: int = TOP) -> list[dict[str, Any]]:
    """Per leaf module, the sum over ``tables`` of its median finite value; the largest first.

    A parent's time and memory include its children's, so the leaves, the layers that do
    the work, are ranked.
    """
    totals: dict[str, float] = {}
    for table in tables:
        finite = np.where(np.isfinite(table.values), table.values, np.nan)
        measured = ~np.all(np.isnan(finite), axis=1)
        if not measured.any():
            continue
        medians = np.nanmedian(finite[measured], axis=1)
        for name, median in zip(np.asarray(table.names, dtype=object)[measured], medians.tolist()):
            totals[name] = totals.get(name, 0.0) + median
    parents = _parents(totals)
    leaves = {name: value for name, value in totals.items() if name not in parents}
    ranked = sorted(leaves.items(), key=lambda item: -item[1])[:top]
    return [{"name": name, unit: value} for name, value in ranked]


def norms(table: Table, until: Optional[int] = None, top: int = TOP) -> dict[str, list[dict[str, Any]]]:
    """The largest norms at the last sample (before step ``until``, when given), and those
    that changed most from the first sample to that one (by the factor's size either way)."""
    ends = _ends(table, until)
    if ends is None:
        return {"largest": [], "fastest_changing": []}
    names, first, last, first_at, last_at = ends
    finals = [
        {"name": names[i], "step": int(table.steps[last_at[i]]), "value": float(last[i])}
        for i in np.argsort(-last, kind="stable")[:top].tolist()
    ]
    changing = np.flatnonzero((first > 0) & (last > 0) & (last_at > first_at))
    size = np.abs(np.log(last[changing] / first[changing]))
    return {"largest": finals, "fastest_changing": _changes(table, ends, changing[np.argsort(-size, kind="stable")[:top]])}


def growth(table: Table, top: int = TOP) -> list[dict[str, Any]]:
    """The norms that grew most from the first sample to the last (the factor, largest first)."""
    ends = _ends(table, None)
    if ends is None:
        return []
    _, first, last, first_at, last_at = ends
    changing = np.flatnonzero((first > 0) & (last > 0) & (last_at > first_at))
    factor = last[changing] / first[changing]
    return _changes(table, ends, changing[np.argsort(-factor, kind="stable")[:top]])


def _ends(table: Table, until: Optional[int]) -> Optional[tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer with a finite value (before ``until``): its name, first and last finite
    values, and their columns."""
    usable = np.isfinite(table.values)
    if until is not None:
        usable &= table.steps[None, :] < until
    rows = np.flatnonzero(usable.any(axis=1))
    if rows.size == 0:
        return None
    usable = usable[rows]
    first_at = usable.argmax(axis=1)
    last_at = usable.shape[1] - 1 - usable[:, ::-1].argmax(axis=1)
    names = [table.names[i] for i in rows.tolist()]
    return names, table.values[rows, first_at], table.values[rows, last_at], first_at, last_at


def _changes(table: Table, ends: tuple, order: np.ndarray) -> list[dict[str, Any]]:
    names, first, last, first_at, last_at = ends
    return [
        {"name": names[i], "from_step": int(table.steps[first_at[i]]), "to_step": int(table.steps[last_at[i]]),
         "first": float(first[i]), "last": float(last[i]), "factor": float(last[i] / first[i])}
        for i in order.tolist()
    ]


def _parents(names: dict[str, float]) -> set[str]:
    """The names among ``names``' ancestors (``(root)`` when any other name is there)."""
    parents = {ROOT} if len(names) > 1 else set()
    for name in names:
        parts = name.split(".")
        parents.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return parents
