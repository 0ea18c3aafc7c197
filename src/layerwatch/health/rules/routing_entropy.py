"""``routing_entropy_collapse``: a Mixture-of-Experts router's routing entropy (of the softmax of
a token's router logits, its mean over the step's tokens: ``moe_entropy``) falling far below its
own past: the router turning certain of every token's expert.

Broken when its median over the last ``window`` samples is below ``AlertRules.
router_entropy_collapse`` (0.25) of the highest median of a window before: the attention rule
``entropy_collapse``'s test on the router (Zhai et al. 2023 for attention). Uniform routing is at
``log E``; a router that learns lowers it, so against its own past, and a growth rule
(``GROWTH_KINDS``): judged once the loss has turned, afresh from its lowest. Healthy tiny runs of
six transformers MoE families keep at least 0.98 of their highest window at lr 1e-3, 0.88 at lr
1e-2; gpt-oss with routers of std 1 at lr 1e-2 falls to 0.12 while its loss falls to 0.01, which
the wait for the loss keeps quiet (docs/alerts.md).
"""

from __future__ import annotations

import math

from layerwatch.health.rules.router_windows import RouterWindows
from layerwatch.health.rules.windows import Trend
from layerwatch.probes.result import RouterLoad


class RoutingEntropy(RouterWindows):
    """Each router's mean routing entropy against its own past (see the module)."""

    kind = "routing_entropy_collapse"
    measure = "entropy"

    def broken(self, trend: Trend) -> bool:
        return trend.fell(self.rules.router_entropy_collapse)

    def say(self, router: str, load: RouterLoad, trend: Trend) -> str:
        rules = self.rules
        share = trend.now / trend.highest if trend.highest else 0.0
        return (
            f"routing entropy of {router} collapsed to {trend.now:.3g} nats (mean over tokens, median of {rules.window} "
            f"samples), {share:.2g} of the {trend.highest:.3g} it had (uniform routing: log {load.tokens.size} = "
            f"{math.log(load.tokens.size):.3g}; AlertRules.router_entropy_collapse is {rules.router_entropy_collapse:g}): "
            "the router is certain of every token's expert, its top-1 margin up (moe_margin), and the experts it "
            "passes over stop learning. A load-balancing loss, a router z-loss, or a lower learning rate for the router?")
