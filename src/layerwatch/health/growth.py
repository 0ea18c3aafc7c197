"""Which layers grew most between two samples: the ranking that explains a loss spike
(:meth:`~layerwatch.health.spikes.Spikes.explain`). Plain host arithmetic over a sample's rows and
probes, kept one sample back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from layerwatch.measure.params import update_ratios
from layerwatch import stats as S
from layerwatch.probes import ProbeResult
from layerwatch.vocabulary import ROOT, parent


@dataclass(frozen=True)
class Growth:
    """How much a layer's gradient norm, update ratio or output norm (``what``) grew against the sample before."""

    layer: str
    what: str  # "gradient", "update" or "output"
    factor: float
    before: float
    now: float

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "what": self.what, "factor": self.factor, "before": self.before, "now": self.now}


class LayerGrowth:
    """Each layer's gradient norm and update ratio, and each module's output norm, at the last
    sample: a sample's are ranked against them by how much they grew.

    A module's output grows with its input's: where the sample's forward was probed, the
    leaf modules are also ranked by how much more their output grew than the output of the
    leaf called before them (in model order: their input, in a chain), so that the module
    where a growth began comes first, not those it carried on to (:meth:`origin`: those that
    grew ``BEGAN`` times more than their input or more; a gradient that grew alone has none).

    A sample is only kept (no work per tensor) until a spike asks for a ranking."""

    TOP = 5
    BEGAN = 2.0  # a module's output grew at least this many times more than its input's: a growth began there

    def __init__(self) -> None:
        self._last: Optional[tuple[S.HostRows, Optional[ProbeResult]]] = None

    def observe(self, rows: S.HostRows, probes: Optional[ProbeResult], rank: bool) -> tuple[list[Growth], list[Growth]]:
        """With ``rank``: the layers whose gradient or update grew most since the last sample,
        largest first (at most ``TOP``, each layer once), and the leaf modules whose output grew
        most beyond their input's (:meth:`origin`). This sample is kept for the next call."""
        last, self._last = self._last, (rows, probes)
        if not rank or last is None:
            return [], []
        before = _per_parameter(last[0])
        best: dict[str, Growth] = {}
        for (what, name), value in _per_parameter(rows).items():
            growth = _growth(what, parent(name) or name, before.get((what, name)), value)
            if growth is not None and (growth.layer not in best or growth.factor > best[growth.layer].factor):
                best[growth.layer] = growth
        return sorted(best.values(), key=lambda g: -g.factor)[: self.TOP], self.origin(dict(_outputs(last[1])), _outputs(probes))

    def origin(self, before: dict[str, float], outputs: list[tuple[str, float]]) -> list[Growth]:
        """The leaf modules of ``outputs`` (name and output norm, in model order) ranked by their
        output's growth since ``before`` over the growth of the leaf's before them (the first
        leaf's input, the batch, is taken as unchanged), those of ``BEGAN`` or more: ``factor``
        is that ratio, ``before`` and ``now`` the module's own norms."""
        # Model order is depth first: a module with a measured descendant is followed by one.
        after = [name for name, _ in outputs[1:]] + [""]
        leaves = [(name, value) for (name, value), following in zip(outputs, after)
                  if name != ROOT and not following.startswith(name + ".")]
        ranked, carried = [], 1.0
        for name, value in leaves:
            growth = _growth("output", name, before.get(name), value)
            if growth is None:
                carried = 1.0  # not known: the next leaf is judged on its own growth
                continue
            ranked.append(Growth(name, "output", growth.factor / carried if carried > 0 else growth.factor,
                                 growth.before, growth.now))
            carried = growth.factor
        return sorted((g for g in ranked if g.factor >= self.BEGAN), key=lambda g: -g.factor)[: self.TOP]


def _growth(what: str, layer: str, before: Optional[float], now: float) -> Optional[Growth]:
    if before is None or not before > 0 or not math.isfinite(now) or not math.isfinite(before):
        return None
    return Growth(layer, what, now / before, before, now)


def _outputs(probes: Optional[ProbeResult]) -> list[tuple[str, float]]:
    """Each probed module's output norm (its first call's), in model order."""
    measured = [] if probes is None else [t for t in probes.modules if t.activation_row is not None]
    if not measured:
        return []
    norms = S.Rows(np.stack([t.activation_row for t in measured])).norm.tolist()
    return [(t.name, norm) for t, norm in zip(measured, norms)]


def _per_parameter(rows: S.HostRows) -> dict[tuple[str, str], float]:
    """Each parameter's gradient norm and update ratio in ``rows``, keyed ``("gradient", name)``, ``("update", name)``."""
    out = {("gradient", name): float(norm) for names, r in rows.get(S.GRAD_ROWS, ()) for name, norm in zip(names, S.Rows(r).norm)}
    weights = {name: norm for names, r in rows.get(S.WEIGHT_ROWS, ()) for name, norm in zip(names, S.Rows(r).norm)}
    for names, (deltas, after) in rows.get(S.UPDATE_ROWS, ()):
        out.update(zip([("update", name) for name in names], update_ratios(names, deltas, after, weights).tolist()))
    return out
