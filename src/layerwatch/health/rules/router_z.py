"""``router_z_growth``: a Mixture-of-Experts router's log Z (the logsumexp of a token's router
logits, its mean over the step's tokens: ``moe_router_z``) growing against its own past.

Broken when its median over the last ``window`` samples is ``AlertRules.router_z_growth`` (5)
nats or more above the lowest median of a window before. A difference, not a ratio: log Z is a
logarithm (``log E`` at initialization, when the logits are near 0), and 5 nats is a top expert
whose weight before the softmax grew e^5 = 148 times. Router logits that grow come before the
instabilities of MoE training, and ST-MoE's router z-loss (Zoph et al. 2022) exists to hold them
down, as PaLM's z-loss does the output head's (``logit_drift``).

A growth rule (``GROWTH_KINDS``): judged once the loss has turned, afresh from its lowest, since a
router that learns sharpens its logits too. Healthy tiny runs of six transformers MoE families
grow it at most 0.04 nats at lr 1e-3, 0.17 at lr 1e-2; gpt-oss with routers of std 1 at lr 1e-2
grows it 5.2 while its loss falls to 0.01, which the wait for the loss keeps quiet (docs/alerts.md).
"""

from __future__ import annotations

from layerwatch.health.rules.router_windows import RouterWindows
from layerwatch.health.rules.windows import Trend
from layerwatch.probes.result import RouterLoad


class RouterZ(RouterWindows):
    """Each router's mean log Z against its own past (see the module)."""

    kind = "router_z_growth"
    measure = "z_mean"

    def broken(self, trend: Trend) -> bool:
        return trend.rose(self.rules.router_z_growth)

    def say(self, router: str, load: RouterLoad, trend: Trend) -> str:
        rules = self.rules
        return (
            f"router {router}'s log Z (logsumexp of a token's router logits, mean) grew from {trend.lowest:.3g} to "
            f"{trend.now:.3g} nats (medians of {rules.window} samples; its largest now {load.z_max:.3g}; AlertRules."
            f"router_z_growth is {rules.router_z_growth:g}): router logits growing, which comes before the "
            "instabilities of MoE training (Zoph et al. 2022). A router z-loss (ST-MoE: 1e-3 (log Z)^2), or a lower "
            "learning rate for the router?")
