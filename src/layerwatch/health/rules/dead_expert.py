"""``dead_expert``: an expert of a Mixture-of-Experts router that got no token at
``AlertRules.window`` (5) samples in a row. Its weights then get no gradient and stop learning,
and the layer runs on fewer experts than it has (a dead expert: the research note's "no tokens
over a window"; Fedus et al. 2022 and DeepSeek-V3's aux-free bias balance the load to avoid it).

The alert names the expert, ``<router>#<e>`` (the row of its ``moe_tokens``), once each. A sample
whose router had fewer than ``FAIR_TOKENS`` (4) tokens per expert on average is not judged (it
neither counts nor breaks a run): with so few, an idle expert is chance.
"""

from __future__ import annotations

import numpy as np

from layerwatch.health.rules.router_windows import FAIR_TOKENS, enough_tokens, router_loads
from layerwatch.health.rules.rule import Broken, Rule, Seen
from layerwatch.options import AlertRules
from layerwatch.vocabulary import expert_name


class DeadExpert(Rule):
    """Counts, per router and expert, the samples in a row the expert got no token."""

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self._idle: dict[str, np.ndarray] = {}  # router -> per expert, judged samples in a row without a token

    def observe(self, seen: Seen) -> list[Broken]:
        found, n = [], self.rules.window
        for router, load in router_loads(seen):
            if not enough_tokens(load):
                continue
            idle = self._idle.get(router)
            if idle is None or idle.shape != load.tokens.shape:
                idle = np.zeros(load.tokens.shape, dtype=int)
            self._idle[router] = idle = np.where(load.tokens == 0, idle + 1, 0)
            fair = float(load.tokens.mean())
            found += [Broken("dead_expert", expert_name(router, int(e)), (
                f"expert {expert_name(router, int(e))} got no token at {n} samples in a row, where its fair share was "
                f"{fair:.3g} tokens a sample (AlertRules.window is {n}; samples under {FAIR_TOKENS:g} tokens an expert "
                "are not judged): its weights get no gradient and stop learning, and the layer runs on fewer experts. "
                "A load-balancing loss (transformers: output_router_logits=True), an aux-free balancing bias, or "
                "re-initialize its router row?")) for e in np.flatnonzero(idle >= n)]
        return found
