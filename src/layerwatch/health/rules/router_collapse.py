"""``router_collapse``: a Mixture-of-Experts router sending (nearly) every token to one expert,
where it did not before.

The busiest expert's share of the tokens (each token counted once) is fair at ``k/E`` (``top_k``
of ``E`` experts) and 1 when every token goes to it; the rule judges how far it has gone from the
one toward the other, its concentration ``(share - k/E) / (1 - k/E)``
(:func:`~layerwatch.routing.concentration`: 0 balanced, 1 collapsed, whatever ``k`` and
``E``; it bounds the top-k experts' combined share from above). Broken when its median over the
last ``RECENT`` (3) samples is at least ``AlertRules.router_collapse`` (0.8) **and** at least
``router_collapse_growth`` (1.5) times the lowest median of a window (``window`` samples) before:
against the router's own past, so a router that routes this way from its first samples is not
judged by the level alone (its idle experts are ``dead_expert``'s). The median of 3 moves at the
second sample of a collapse, and one odd batch does not move it.

Judged at every sample, not only once the loss has turned: a collapsed router wastes the
layer's other experts whatever the loss does (Shazeer et al. 2017: the gate "tends to converge
to a state where it always produces large weights for the same few experts"; Fedus et al. 2022
balance it with an auxiliary loss). Healthy tiny runs of six transformers MoE families stay at
most 0.24 at lr 1e-3, 0.53 at lr 1e-2 (a median of 3; one sample 0.86; docs/alerts.md); an
offset of 30 on one expert's logit makes it 1.0 at once, one of 0.3 (2.5 standard deviations of
Mixtral's router logits at initialization) 0.85. Samples with fewer than ``FAIR_TOKENS`` tokens per expert are not judged.
"""

from __future__ import annotations

import numpy as np

from layerwatch.health.rules.router_windows import RouterWindows, enough_tokens
from layerwatch.health.rules.windows import Trend
from layerwatch.probes.result import RouterLoad
from layerwatch.vocabulary import expert_name

RECENT = 3  # samples of the last window: a collapse is told at its second sample


class RouterCollapse(RouterWindows):
    """The busiest expert's concentration of each router against its own past (see the module)."""

    kind = "router_collapse"
    measure = "concentration"
    recent = RECENT

    def signal(self, load: RouterLoad) -> float:
        return super().signal(load) if enough_tokens(load) else float("nan")

    def broken(self, trend: Trend) -> bool:
        return trend.now >= self.rules.router_collapse and trend.now >= self.rules.router_collapse_growth * trend.lowest

    def say(self, router: str, load: RouterLoad, trend: Trend) -> str:
        rules, tokens = self.rules, load.tokens
        busiest, k = int(np.argmax(tokens)), load.top_k
        return (
            f"routing of {router} collapsed onto expert {expert_name(router, busiest)}: it took {int(tokens[busiest])} "
            f"of the {int(tokens.sum()) // k} tokens at this sample (fair: {k}/{tokens.size} of them). Its concentration "
            f"(0: its fair share, 1: every token) is {trend.now:.2f} over the last {RECENT} samples (median), up from "
            f"{trend.lowest:.2f} ({rules.window} samples; AlertRules.router_collapse is {rules.router_collapse:g}, "
            f"router_collapse_growth {rules.router_collapse_growth:g}): the other experts get ever fewer tokens and "
            "stop learning (Shazeer et al. 2017). A load-balancing loss (transformers: output_router_logits=True and "
            "router_aux_loss_coef), router jitter, or a lower learning rate?")
