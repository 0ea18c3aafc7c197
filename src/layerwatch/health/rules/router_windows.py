"""What the routers' rules share: each Mixture-of-Experts router's load at a sample
(:func:`router_loads`, the probes' ``moe`` family: :class:`~layerwatch.probes.result.RouterLoad`),
and :class:`RouterWindows`, a rule on one signal of each router judged by its
:class:`~layerwatch.health.rules.windows.Windows`, the windows the attention rules judge by
(:mod:`.router_collapse`, :mod:`.router_z`, :mod:`.routing_entropy`). :mod:`.dead_expert` counts
samples in a row instead.
"""

from __future__ import annotations

from typing import Optional

from layerwatch.health.alert import GROWTH_KINDS
from layerwatch.health.rules.rule import Broken, Rule, Seen
from layerwatch.health.rules.windows import Trend, Windows
from layerwatch.options import AlertRules
from layerwatch.probes.result import RouterLoad

# The fewest tokens per expert, on average (tokens * k / E), at which a router's load is judged:
# with fewer, one batch's chance decides which experts are busy or idle (a live expert with its
# fair share of 4 misses 5 samples in a row with a chance of e^-20).
FAIR_TOKENS = 4.0


def router_loads(seen: Seen) -> list[tuple[str, RouterLoad]]:
    """Each router's load at the sample, by its module's name; none where no router was measured."""
    return list((getattr(seen.probes, "routers", None) or {}).items())


def enough_tokens(load: RouterLoad) -> bool:
    """Whether ``load`` routed ``FAIR_TOKENS`` tokens per expert or more, on average."""
    return bool(load.tokens.size) and float(load.tokens.mean()) >= FAIR_TOKENS


class RouterWindows(Rule):
    """A rule on one signal of each router (:meth:`signal`), judged against the router's own past
    by its windows' :class:`Trend` (:meth:`broken`). Of the growth kinds (``GROWTH_KINDS``) it
    judges only once the loss has turned, afresh from its lowest; the others at every sample."""

    kind = ""
    measure = ""  # the RouterLoad attribute judged (None: not measured at the sample)
    recent: Optional[int] = None  # samples of the last window; AlertRules.window when None

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self.growth = self.kind in GROWTH_KINDS
        self._windows = Windows(rules.window, self.recent)

    def restart(self) -> None:
        """A growth rule judges afresh from here (:meth:`Windows.restart`); the others keep their past."""
        if self.growth:
            self._windows.restart()

    def observe(self, seen: Seen) -> list[Broken]:
        found = []
        for router, load in router_loads(seen):
            trend = self._windows.add(router, self.signal(load))  # NaN: not judged at this sample
            if trend is not None and (seen.turned or not self.growth) and self.broken(trend):
                found.append(Broken(self.kind, router, self.say(router, load, trend)))
        return found

    def signal(self, load: RouterLoad) -> float:
        """The router's signal at this sample (its ``measure``); NaN where it has none."""
        value = getattr(load, self.measure)
        return float("nan") if value is None else float(value)

    def broken(self, trend: Trend) -> bool:
        """Whether the router's windows break the rule."""
        raise NotImplementedError

    def say(self, router: str, load: RouterLoad, trend: Trend) -> str:
        """The alert's message."""
        raise NotImplementedError
