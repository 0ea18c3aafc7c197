"""The health rules, one small module each, every one a :class:`~layerwatch.health.rules.rule.Rule`:
given what a sampled step shows (``Seen``), the rules it finds broken (``Broken``).

- ``nonfinite`` (:mod:`.nonfinite`): NaN or Inf in the weights or gradients;
- ``exploding`` / ``vanishing``: a tensor's norm outside its absolute bounds (:mod:`.norm_bounds`),
  or a layer's size against its own past (:mod:`.layer_windows`);
- ``dead`` (:mod:`.dead`) and ``stuck`` (:mod:`.stuck`);
- ``sign_like`` / ``eps_bound``: Adam's own state (:mod:`.update_shape`);
- ``attention_logits``, ``entropy_collapse``, ``logit_drift``, ``outlier_growth``: the probes'
  transformer signals (:mod:`.probe_trends`), with the windows they share (:mod:`.windows`);
- ``router_collapse`` (:mod:`.router_collapse`), ``dead_expert`` (:mod:`.dead_expert`),
  ``router_z_growth`` (:mod:`.router_z`), ``routing_entropy_collapse`` (:mod:`.routing_entropy`):
  each Mixture-of-Experts router against its own past (what they share: :mod:`.router_windows`).

:func:`every_rule` is the order they are asked in, and so the order of a step's alerts.
"""

from __future__ import annotations

from layerwatch.health.rules.dead import Dead
from layerwatch.health.rules.layer_windows import LayerWindows
from layerwatch.health.rules.nonfinite import NonFinite
from layerwatch.health.rules.norm_bounds import NormBounds
from layerwatch.health.rules.dead_expert import DeadExpert
from layerwatch.health.rules.probe_trends import ProbeTrends
from layerwatch.health.rules.router_collapse import RouterCollapse
from layerwatch.health.rules.router_z import RouterZ
from layerwatch.health.rules.routing_entropy import RoutingEntropy
from layerwatch.health.rules.rule import Broken, Rule, Seen, Tensors
from layerwatch.health.rules.stuck import Stuck
from layerwatch.health.rules.update_shape import UpdateShape
from layerwatch.options import AlertRules
from layerwatch.vocabulary import Family

__all__ = ["Broken", "Rule", "Seen", "Tensors", "every_rule"]


def every_rule(rules: AlertRules) -> list[Rule]:
    """The rules with ``rules``' thresholds, in the order a step's alerts are raised."""
    return [NonFinite(), NormBounds(rules, Family.WEIGHTS), LayerWindows(rules, Family.WEIGHTS),
            NormBounds(rules, Family.GRADS), LayerWindows(rules, Family.GRADS), Dead(rules), Stuck(rules), UpdateShape(rules),
            ProbeTrends(rules), RouterCollapse(rules), DeadExpert(rules), RouterZ(rules), RoutingEntropy(rules)]
