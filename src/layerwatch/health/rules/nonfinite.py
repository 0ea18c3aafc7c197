"""``nonfinite``: NaN or Inf in a parameter's weights or gradients, one alert a layer, its
gradients named first (at most three tensors, then how many more).

Thresholds: none; any NaN or Inf counts. The first offender (the module whose output or
gradient turned non-finite first) is named outside the rules, by the probes
(:meth:`~layerwatch.faults.faults.Faults.offender_alerts`), and raised before them.
"""

from __future__ import annotations

import numpy as np

from layerwatch.health.rules.rule import Broken, Rule, Seen, owner
from layerwatch.vocabulary import parent


class NonFinite(Rule):
    """NaN/Inf in the weights' or the gradients' rows."""

    def observe(self, seen: Seen) -> list[Broken]:
        found: dict[str, list[str]] = {}  # layer -> what holds NaN/Inf, gradients first
        first_param: dict[str, str] = {}
        for what, tensors in (("gradients", seen.grads), ("weights", seen.weights)):
            if tensors is None:
                continue
            counts = tensors.rows.nonfinite
            for i in np.flatnonzero(counts > 0):
                name = seen.names[tensors.slots[i]]
                found.setdefault(parent(name), []).append(f"{what} of {name} ({int(counts[i]):,})")
                first_param.setdefault(parent(name), name)
        return [Broken("nonfinite", owner(first_param[layer]), "NaN/Inf values in " + ", ".join(parts[:3]) +
                        (f" and {len(parts) - 3} more" if len(parts) > 3 else ""))
                for layer, parts in found.items()]
