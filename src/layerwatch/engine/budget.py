"""The default schedule: sample as often as an overhead budget allows.

A :class:`Pacer` answers "is step ``k`` sampled?" as a schedule does (``k % interval == 0``)
and chooses the interval from what the engine measures:

- ``C``, the added cost of a sampled step (``overhead_ms``; the first sample of a run, which
  pays one-off costs such as plans and the layer table, is left out);
- ``T``, the base step time: the wall time from one step's start to the next one's, over
  recent unsampled steps (a median);
- ``s``, what an unsampled step costs layerwatch itself (the NaN sentinel, the schedule).

The checks made every step (the NaN sentinel's) may take ``PER_STEP_SHARE`` of the budget.
Where they take more (a model of many small tensors: their host work is per tensor), the
pacer spreads them over more steps (:meth:`Pacer.spread_for`), and the samples get the rest:
a per-step cost that spreading can bring down never drives the interval to ``MAX_INTERVAL``.
Checks that cost under ``CHECKS_FLOOR_S`` a step are kept whole.

Samples the pacer did not schedule (a NaN's, a loss spike's capture) are taken whatever it
says, and paid out of the budget over a long horizon: their costs over the last ``EXTRA_SPAN``
steps, per step, ``e``, are counted with ``s`` (:meth:`Pacer.unscheduled`). A run in trouble is
watched, not abandoned: an incident (such a sample, or an alert: :meth:`Pacer.incident`) holds
the interval where it was for ``HOLD_STEPS`` steps (it may shrink, never grow), and what
incidents cost never takes the interval beyond twice what it was before the first of them.

Sampling every ``n`` steps costs ``C / n + s + e`` per step, so the interval is the smallest value
of the 1-2-5 grid (1, 2, 5, 10, 20, 50, ...) with ``C / n + s + e <= HEADROOM * budget * T``: ``C``
is known to within 20%, and the budget is a ceiling. Until the first
cost is known every step is sampled (the first two steps of a run). The interval is
re-evaluated at each sampled step it scheduled. It grows at once when the budget is
exceeded, and shrinks only when the ideal has moved two grid steps below it, so a chart's
cadence does not flap with the noise of the measurements. Sampled steps are multiples of the
interval: two runs on the same hardware sample the same steps.

Deciding on an unsampled step is a modulo and two appends: plain Python, O(1).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional

from layerwatch.options import check_fraction

MAX_INTERVAL = 10_000  # sampling less often than this is not worth a budget: say so instead
HEADROOM = 0.8  # overhead_ms reads within 20% of a sample's measured cost: plan for 80% of the budget
FIRST_BASE_SHARE = 0.1  # the least share of a first sample's time taken as the base step
WINDOW = 32  # recent measurements each median is taken over
PER_STEP_SHARE = 0.5  # of the budget's headroom: what the checks made every step may take
MAX_SPREAD = 1024  # the most steps the per-step checks are spread over (a share is one tensor before that)
CHECKS_FLOOR_S = 50e-6  # per-step checks cheaper than this are kept whole: spreading them saves little, loses a replay
EXTRA_SPAN = 10_000  # the steps an unscheduled sample's cost is spread over
HOLD_STEPS = 1000  # after an incident, the steps the interval does not grow for


def grid_value(index: int) -> int:
    """The ``index``-th value of the 1-2-5 grid: 1, 2, 5, 10, 20, 50, 100, ..."""
    return (1, 2, 5)[index % 3] * 10 ** (index // 3)


def grid_index(value: float) -> int:
    """The index of the smallest grid value >= ``value`` (0 for anything up to 1)."""
    if value <= 1:
        return 0
    index = 3 * max(0, int(math.log10(value)) - 1)
    while grid_value(index) < value:
        index += 1
    return index


class Pacer:
    """The overhead budget as a schedule (see the module's docstring).

    Args:
        budget: The share of the training time sampling may add, in (0, 1].
    """

    def __init__(self, budget: float) -> None:
        self.budget = check_fraction("overhead_budget", budget)
        self.interval: Optional[int] = None  # None: not chosen yet, every step is sampled
        self._base_s: deque[float] = deque(maxlen=WINDOW)  # wall time of unsampled steps
        self._own_s: deque[float] = deque(maxlen=WINDOW)  # layerwatch's own time in them
        self._checks_s: deque[float] = deque(maxlen=WINDOW)  # of which the per-step checks' (the sentinel)
        self._costs_s: deque[float] = deque(maxlen=WINDOW)  # added cost of sampled steps
        self._extra: deque[tuple[int, float]] = deque()  # (step, cost) of the unscheduled samples of the last EXTRA_SPAN steps
        self._step = 0  # the latest step a sample was seen at
        self._samples_seen = 0
        self._hold_until = -1  # the interval does not grow before this step (an incident's)
        self._before_incidents: Optional[int] = None  # the interval before the unscheduled samples still paid for

    def __call__(self, step: int) -> bool:
        interval = self.interval
        return interval is None or step % interval == 0

    def __repr__(self) -> str:
        every = "not chosen yet" if self.interval is None else f"every {self.interval} steps"
        return f"overhead_budget({self.budget:g}): {every}"

    def resume(self, interval: int) -> None:
        """Sample every ``interval`` steps from now: the interval the run this one resumes had, or
        the one rank 0 shared."""
        self.interval = interval

    def off_step(self, wall_s: float, own_s: float, checks_s: float = 0.0) -> None:
        """An unsampled step took ``wall_s`` from its start to the next step's, ``own_s`` of it
        in layerwatch, ``checks_s`` of that in the checks made every step."""
        self._base_s.append(wall_s)
        self._own_s.append(own_s)
        self._checks_s.append(checks_s)

    def checks_allowance(self) -> float:
        """The seconds the checks made every step may take: ``PER_STEP_SHARE`` of the budget's
        headroom of the base step time, and never less than ``CHECKS_FLOOR_S`` (below it their
        fixed costs, which no spreading saves, are most of what they cost)."""
        return max(PER_STEP_SHARE * HEADROOM * self.budget * statistics.median(self._base_s), CHECKS_FLOOR_S)

    def spread_for(self, spread: int) -> Optional[int]:
        """The spread (the steps the per-step checks are spread over: ``spread`` now) that
        brings their median time within :meth:`checks_allowance`: ``spread`` itself when it is
        within, None when too few steps were measured since (or at ``MAX_SPREAD``). What they
        cost after a new spread is assumed to be the allowance, until it is measured."""
        if len(self._checks_s) < 3 or spread >= MAX_SPREAD:
            return None
        checks, allowance = statistics.median(self._checks_s), self.checks_allowance()
        if checks <= allowance:
            return spread
        fixed = max(statistics.median(self._own_s) - checks, 0.0)
        self._checks_s.clear()
        self._own_s.clear()
        self._own_s.append(fixed + allowance)
        return min(math.ceil(spread * checks / allowance), MAX_SPREAD)

    def sampled(self, cost_s: float, step_s: float, step: Optional[int] = None) -> None:
        """A step this pacer scheduled (``step``) was sampled: it added ``cost_s`` and ran ``step_s``
        from its start to its end, cost included."""
        self._step = self._step if step is None else step
        self._samples_seen += 1
        if self._samples_seen == 1:
            return  # the first sample pays for plans and the layer table once
        self._costs_s.append(cost_s)
        if len(self._base_s) < 3:  # no unsampled step yet (the first samples): the sample's own time
            # less its cost, and at least a tenth of it: a base read too short would choose an
            # interval too long to be corrected before its next sample; one read too long is
            # corrected there, since the interval grows at once
            self._base_s.append(max(step_s - cost_s, FIRST_BASE_SHARE * step_s))

    def unscheduled(self, step: int, cost_s: float) -> None:
        """Step ``step``, which this pacer did not schedule, was sampled (a fault's or a spike's
        capture) and added ``cost_s``: paid out of the budget over the ``EXTRA_SPAN`` steps after
        it. An incident (:meth:`incident`)."""
        self._step = step
        self._extra.append((step, cost_s))
        self.incident(step)

    def incident(self, step: int) -> None:
        """Something went wrong at ``step`` (a fault, a spike, an alert): the interval does not
        grow for ``HOLD_STEPS`` steps."""
        self._step = max(self._step, step)
        self._hold_until = max(self._hold_until, step + HOLD_STEPS)

    def extra_per_step(self) -> float:
        """The unscheduled samples' cost per step, over the last ``EXTRA_SPAN`` steps."""
        while self._extra and self._extra[0][0] <= self._step - EXTRA_SPAN:
            self._extra.popleft()
        return sum(cost for _, cost in self._extra) / EXTRA_SPAN

    def ideal(self, extra: bool = True) -> Optional[float]:
        """The interval that spends exactly ``HEADROOM`` of the budget (inf: none does), with
        the unscheduled samples' cost (``extra``) or without; None before a cost is known."""
        if not self._costs_s:
            return None
        spare = (HEADROOM * self.budget * statistics.median(self._base_s) - statistics.median(self._own_s or [0.0])
                 - (self.extra_per_step() if extra else 0.0))
        return math.inf if spare <= 0 else statistics.median(self._costs_s) / spare

    def decide(self) -> Optional[int]:
        """The interval from here on: a new one, or None when it stays. Within ``HOLD_STEPS`` of
        an incident it does not grow; what incidents cost takes it at most to the largest grid
        value within twice the interval before them."""
        ideal = self.ideal()
        if ideal is None:
            return None
        wanted = _on_grid(ideal)
        if not self._extra:
            self._before_incidents = None
        elif self._before_incidents is None:
            self._before_incidents = self.interval  # the first decision since they came: the interval they found
        if self._extra and self._before_incidents is not None:
            own = _on_grid(self.ideal(extra=False))  # what the run's own samples ask for
            doubled = grid_value(grid_index(2 * self._before_incidents + 1) - 1)  # the largest grid value <= 2x
            wanted = max(own, min(wanted, doubled))
        if self.interval is not None and self._step < self._hold_until and wanted > self.interval:
            return None  # a run in trouble: watched as densely as before
        if self.interval is not None and grid_index(self.interval) - 2 < grid_index(wanted) <= grid_index(self.interval):
            return None  # within the budget, and not two grid steps below: kept
        return wanted

    def expected_share(self, interval: int) -> float:
        """What sampling every ``interval`` steps costs, as a share of the base step time."""
        base = statistics.median(self._base_s)
        own = statistics.median(self._own_s or [0.0])
        cost = statistics.median(self._costs_s) if self._costs_s else 0.0
        return (cost / interval + own + self.extra_per_step()) / base

    def message(self, previous: Optional[int]) -> str:
        """The one line that tells the user the interval (after a change to it)."""
        interval = self.interval
        budget = f"{100 * self.budget:g}%"
        was = "" if previous is None else f" (was every {previous})"
        if interval == MAX_INTERVAL and self.expected_share(interval) > self.budget:
            return (f"layerwatch: sampling every {interval} steps{was}, the longest interval, which still costs "
                    f"~{100 * self.expected_share(interval):.1f}% of the training time, over the {budget} overhead "
                    "budget; pass every_n_steps= to fix the interval, or sentinel=False")
        return (f"layerwatch: sampling every {interval} steps{was} to stay within a {budget} overhead budget; "
                "pass every_n_steps= to fix the interval")


def _on_grid(ideal: float) -> int:
    """The interval of the grid for an ``ideal`` one: the smallest grid value at or above it, up to ``MAX_INTERVAL``."""
    return MAX_INTERVAL if ideal > MAX_INTERVAL else grid_value(grid_index(ideal))
