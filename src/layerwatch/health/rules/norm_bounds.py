"""``exploding`` / ``vanishing`` by absolute bounds: a tensor's norm above or below the bound
set for its family, per tensor (the layer is named). Thresholds: ``AlertRules.weight_norm_bounds``
and ``AlertRules.grad_norm_bounds``, ``(low, high)``, either None (the default: no bound).

Non-finite tensors are left to ``nonfinite``, which speaks for them. The window rules on the
same families, judged per layer against its own past, are
:class:`~layerwatch.health.rules.layer_windows.LayerWindows`.
"""

from __future__ import annotations

import numpy as np

from layerwatch.vocabulary import Family
from layerwatch.health.rules.rule import Broken, Rule, Seen, owner
from layerwatch.options import AlertRules


class NormBounds(Rule):
    """The absolute norm bounds of one family: the weights or the gradients."""

    def __init__(self, rules: AlertRules, family: Family) -> None:
        self.family = family
        weights = family == Family.WEIGHTS
        self.bounds = rules.weight_norm_bounds if weights else rules.grad_norm_bounds
        self.label, self.option = ("weight", "weight_norm_bounds") if weights else ("gradient", "grad_norm_bounds")

    def observe(self, seen: Seen) -> list[Broken]:
        tensors = seen.weights if self.family == Family.WEIGHTS else seen.grads
        if tensors is None:
            return []
        finite = tensors.rows.finite  # the nonfinite alert speaks for the others
        idx, norms = tensors.slots[finite], tensors.rows[finite].norm
        low, high = self.bounds
        found = []
        for i in np.flatnonzero(norms > high) if high is not None else ():
            name = seen.names[idx[i]]
            found.append(Broken("exploding", owner(name), f"{self.label} norm of {name} is {norms[i]:.3g}, above the "
                                 f"bound {high:g} (AlertRules.{self.option})"))
        for i in np.flatnonzero(norms < low) if low is not None else ():
            name = seen.names[idx[i]]
            found.append(Broken("vanishing", owner(name), f"{self.label} norm of {name} is {norms[i]:.3g}, below the "
                                 f"bound {low:g} (AlertRules.{self.option})"))
        return found
