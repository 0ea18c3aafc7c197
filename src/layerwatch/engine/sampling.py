"""When to sample: the schedule's answer, a fault's request, the ranks' vote, the budget's interval.

:class:`Sampling` answers one question a step, :meth:`Sampling.decide`: is this step sampled?
A step is sampled when the schedule says so, or when a fault asked for it (:meth:`ask`). In a
run whose ranks sample together (sharded, or pipeline stages) the ranks vote on it a step
ahead (:class:`~layerwatch.distributed.agreement.StepVote`), rank 0's answer counting. Under the
overhead budget the schedule is a :class:`~layerwatch.engine.budget.Pacer`: rank 0 measures what each
sample cost (:meth:`cost`), chooses the interval, and every rank takes it from rank 0 at the
steps the budget schedules (:meth:`share_interval`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any, Optional, Protocol, Sequence

from layerwatch.engine.budget import Pacer
from layerwatch.distributed.agreement import Ballot, Decision, RankSync, StepVote
from layerwatch.distributed.sharding import is_writer_rank, world_size
from layerwatch.guards.failures import FailurePolicy
from layerwatch.guards.hooks import Attachments
from layerwatch.options import Options
from layerwatch.schedule import Schedule, every_n_steps
from layerwatch.faults.sentinel import Finding

EXCESS_LIMIT = 2.0  # see Sampling.cost
UNSHARED_INTERVAL = 50  # the interval of a distributed run whose ranks cannot share the budget's
SHARE_TIMEOUT_S = 300.0  # how long the ranks wait for each other in a group of their own
SPREAD_EVERY = 8  # a single process weighs the sentinel's cost against its share every that many steps


class VotedFindings(Protocol):
    """The sentinel's side of the vote (:class:`~layerwatch.faults.faults.Faults`)."""

    def unvoted(self) -> Optional[Finding]: ...  # this rank's finding the ranks have not voted on yet

    def on_voted(self, decision: Decision, step: int) -> None: ...  # every rank knows a finding now


class VotedLosses(Protocol):
    """The spike check's side of the vote (:class:`~layerwatch.health.spikes.Spikes`)."""

    def unvoted(self) -> Optional[tuple[int, float]]: ...  # this rank's oldest loss not voted on: its step, its value

    @property
    def has_losses(self) -> bool: ...  # this rank was given a loss (a pipeline stage but the last never is)

    def on_voted(self, decision: Decision, step: int) -> None: ...  # the ranks' largest loss of one step, or none


class Sampling:
    """Which steps are sampled, and (under the overhead budget) what sampling costs.

    Args:
        options: The validated options: their ``schedule``, or their ``budget``.
        failures: Where a failure is warned about.
    """

    def __init__(self, options: Options, failures: FailurePolicy) -> None:
        self.failures = failures
        self.pacer = None if options.budget is None else Pacer(options.budget)
        self.schedule: Schedule | Pacer = options.schedule if self.pacer is None else self.pacer
        self.sync: Optional[RankSync] = None  # the ranks' group for agreeing (and reducing, when sharded)
        self.vote: Optional[StepVote] = None
        self.losses: Optional[VotedLosses] = None  # the losses that ride on the vote (the spike check's)
        self._together = False  # the ranks sample together (sharded, or pipeline stages): by vote, or not at all
        self._interval_sync: Optional[RankSync] = None
        self._proposed_interval: Optional[int] = None  # rank 0's choice at this step, not shared yet
        self.sentinel_spread = 1  # the steps the sentinel's check is spread over (the budget's, shared by rank 0)
        self._checks_measured = False  # the budget measured the per-step checks (see checks_measured)
        self._proposed_spread: Optional[int] = None
        self._forced = False  # a fault asked for a sample
        self._forced_sent = False  # in the ballot last sent
        self._checked = False  # the schedule's first call (its check) was made
        self._last_off_own_s: Optional[float] = None  # the previous step's, when it was unsampled
        self._last_off_checks_s = 0.0  # of which the sentinel's
        # Wall time of the open step since open(), and of recent unsampled steps: a sampled
        # step's cost beyond its neighbours' includes what no timer of ours sees (the module
        # hooks' dispatch in torch, the garbage collector, page faults).
        self.opened_at = 0.0
        self._off_steps: deque[float] = deque(maxlen=16)
        self.last_write_s = 0.0

    def open_groups(self, together: bool, attached: Attachments, losses: Optional[VotedLosses] = None) -> None:
        """At start, on every rank at the same point (making a group is collective): the ranks'
        group for voting when they sample ``together`` (``losses`` ride on the vote then); the
        group that shares the budget's interval in any distributed run, or a fixed interval when
        it cannot be made."""
        self._together = together
        self.losses = losses if together else None
        if together:
            self.failures.run("make the ranks' group for agreeing (no step is sampled)", lambda: self._open_vote(attached), 0)
        if self.pacer is not None and world_size() > 1:
            self._interval_sync = self.sync
            if not together and not self.failures.run(
                    f"make the ranks' group for sharing the sampling interval (every {UNSHARED_INTERVAL} steps instead)",
                    lambda: self._open_interval_sync(attached), 0, otherwise=False):
                self.pacer, self.schedule = None, every_n_steps(UNSHARED_INTERVAL)

    def _open_vote(self, attached: Attachments) -> None:
        self.sync = RankSync()
        self.vote = StepVote(self.sync)
        attached.hold(self.vote)  # waits for its ballot, then closes the group

    def _open_interval_sync(self, attached: Attachments) -> bool:
        self._interval_sync = RankSync(SHARE_TIMEOUT_S)
        attached.hold(self._interval_sync)
        return True

    def close(self) -> None:
        """Forget the groups (closed with the engine's hooks)."""
        self.vote = self.sync = self._interval_sync = None

    def ask(self) -> None:
        """A fault asks for a sample: the next step that may be sampled is."""
        self._forced = True

    # ------------------------------------------------------------------ the step

    def open(self) -> float:
        """A step opens: the previous one's cost goes to the pacer when it was unsampled. Returns
        the time it opened."""
        started = time.perf_counter()
        if self._last_off_own_s is not None and self.pacer is not None:
            self.pacer.off_step(started - self.opened_at, self._last_off_own_s, self._last_off_checks_s)
        self.opened_at = started
        self._last_off_own_s = None
        return started

    def wrote(self, seconds: float) -> None:
        """The last sample's record took ``seconds`` to write: counted in the next sample's cost."""
        self.last_write_s = seconds

    def decide(self, step: int, may_sample: bool, findings: VotedFindings) -> bool:
        """Whether ``step`` is sampled: the schedule says so, or a fault asked for it. In a run
        whose ranks sample together they decide together (every rank asks its schedule, which
        checks it; rank 0's answer counts), a step ahead, and a sentinel's finding rides on
        the vote: ``findings`` gives it to the ballot, and hears the decision that carries one
        before the next ballot goes out."""
        vote = self.vote
        if vote is None and self._together:
            return False  # the ranks cannot agree on a sample, so none is taken
        if vote is None:
            if not (may_sample and (self._forced or self.scheduled(step))):
                return False
            self._forced = False
            return True
        decision = vote.decide(step, lambda at: self._ballot(at, findings))
        if decision.finding_step is not None:
            findings.on_voted(decision, step)
        # Every rank alike (may_sample is the same on every rank): a sample asked for and not
        # taken now is asked for again; one asked for since the ballot went out, in the next.
        asked_since = self._forced and not self._forced_sent and not (decision.sampled and may_sample)
        self._forced = asked_since or (decision.sampled and not may_sample and (self._forced or decision.finding_step is not None))
        if self.losses is not None:  # what it asks for goes out in the next ballot
            self.losses.on_voted(decision, step)
        vote.send(step + 1, self._ballot(step + 1, findings))
        if self.pacer is not None and not decision.forced:  # the ballot went out before the interval last changed
            return may_sample and decision.sampled and self.pacer(step)
        return may_sample and decision.sampled

    def _ballot(self, step: int, findings: VotedFindings) -> Ballot:
        scheduled = self.scheduled(step)
        finding = findings.unvoted()
        self._forced_sent = self._forced
        loss = None if self.losses is None else self.losses.unvoted()
        return Ballot(scheduled and is_writer_rank(), self._forced, None if finding is None else finding.step,
                      finding is not None and finding.nan, loss, loss is None and self.losses is not None and self.losses.has_losses)

    def scheduled(self, step: int) -> bool:
        """The schedule's answer for ``step``. Its first call is its check: what it raises then
        is raised, with the schedule named; later it is warned about once and the step is
        not sampled (a training run is never stopped by it)."""
        schedule = self.schedule
        if self._checked:
            try:
                return schedule(step)
            except Exception as e:
                self.failures.warn_once("schedule", f"layerwatch: schedule {schedule!r} failed for step {step}: {e!r}; "
                                        "such steps are not sampled")
                return False
        try:
            answer = schedule(step)
        except TypeError:
            raise
        except Exception as e:
            raise ValueError(f"schedule {schedule!r} failed for step {step}: {type(e).__name__}: {e}") from e
        self._checked = True
        return answer

    def close_unsampled(self, step: int, entered: float, checks_s: float, own_s: float = 0.0) -> None:
        """An unsampled step ends (its end began at ``entered``; ``checks_s``: the sentinel's
        time in it; ``own_s``: layerwatch's time in it before its end): its wall time is a
        neighbour's for :meth:`cost`; the pacer's steps share the interval."""
        self._off_steps.append(time.perf_counter() - self.opened_at)
        if self.pacer is not None:
            if self.pacer(step):
                self.share_interval(step)
            self._last_off_own_s = own_s + time.perf_counter() - entered
            self._last_off_checks_s = checks_s
            if self._interval_sync is None and step % SPREAD_EVERY == 0:  # no other rank to agree with: now
                self._spread_to(self.pacer.spread_for(self.sentinel_spread))

    def close_sampled(self, step: int) -> None:
        """A sampled step ends, on every rank: the pacer's steps share the interval."""
        if self.pacer is not None and self.pacer(step):
            self.share_interval(step)

    # ------------------------------------------------------------------ the overhead budget

    def cost(self, step: int, measured_s: float, started: float, collected_s: float,
             alerted: Sequence[Any] = ()) -> tuple[float, Optional[int]]:
        """Rank 0, at a sampled step: what sampling added to it, and the budget's interval from
        here on (None under a fixed schedule); an alert raised at it (``alerted``) is an incident
        the budget keeps the run watched through (:meth:`Pacer.incident`).

        The cost is the time measured in our own code (``measured_s``, and since ``started``),
        plus the step's excess over the median recent unsampled step beyond that (what no timer
        of ours sees: torch's slower path for hooked modules, the collector, page faults), taken
        up to ``EXCESS_LIMIT`` times the measured time, plus the garbage collector's time during
        the step (``collected_s``: collections our allocations bring on, in the user's code as
        well as ours): a step slowed by more than that was slowed by something else (a
        validation loop, a checkpoint) and is not put down to sampling. The record's build and
        write are counted at the previous sample's duration (:attr:`last_write_s`): they come
        after this figure."""
        now = time.perf_counter()
        measured = measured_s + now - started + self.last_write_s
        cost_s = measured
        if alerted and self.pacer is not None:
            self.pacer.incident(step)
        if len(self._off_steps) >= 3:
            excess = now - self.opened_at + self.last_write_s - statistics.median(self._off_steps)
            cost_s = min(max(measured, excess), (1 + EXCESS_LIMIT) * measured + collected_s)
        return cost_s, None if self.pacer is None else self._choose_interval(step, cost_s)

    def _choose_interval(self, step: int, cost_s: float) -> int:
        """The interval from here on, and the sentinel's spread when its check costs more than
        its share (proposed to the ranks by :meth:`share_interval`); the step's measurements
        count when the budget scheduled it."""
        pacer = self.pacer
        if pacer(step):  # the step's time counts the write as the cost does: the previous sample's
            pacer.sampled(cost_s, time.perf_counter() - self.opened_at + self.last_write_s, step)
            self._proposed_spread = pacer.spread_for(self.sentinel_spread)
            self._proposed_interval = pacer.decide()
        else:  # a fault's or a spike's: paid out of the budget, never skipped for it
            pacer.unscheduled(step, cost_s)
        return self._proposed_interval or pacer.interval or 1

    def share_interval(self, step: int) -> None:
        """At each step the budget schedules, sampled or not, on every rank alike: take rank
        0's interval and sentinel's spread (one broadcast in a distributed run) and say so when
        they changed."""
        proposed, self._proposed_interval = self._proposed_interval, None
        spread, self._proposed_spread = self._proposed_spread, None
        sync = self._interval_sync
        if sync is not None:
            shared = self.failures.run("share the sampling interval", lambda: sync.broadcast([proposed or 0, spread or 0]), step)
            if shared is None:
                return
            proposed, spread = shared[0] or None, shared[1] or None
        self._spread_to(spread)
        pacer = self.pacer
        if proposed is None or proposed == pacer.interval:
            return
        previous = pacer.interval
        pacer.resume(proposed)
        if is_writer_rank():
            self.failures.say(pacer.message(previous))

    @property
    def checks_measured(self) -> bool:
        """Whether the budget measured the per-step checks; always, with no budget (a fixed
        schedule, or one the ranks fell back to): there is nothing to measure them against."""
        return self.pacer is None or self._checks_measured

    def _spread_to(self, spread: Optional[int]) -> None:
        """Spread the sentinel's check over ``spread`` steps, when that is more (the sentinel
        says what it checks then: :class:`~layerwatch.faults.faults.Faults`); any spread at all says
        the budget measured the checks."""
        if spread is not None:
            self._checks_measured = True
            self.sentinel_spread = max(spread, self.sentinel_spread)

    def state_dict(self) -> dict[str, int]:
        """The overhead budget's interval (empty under a fixed schedule, or before it is chosen)."""
        if self.pacer is None or self.pacer.interval is None:
            return {}
        return {"sample_interval": self.pacer.interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on with a saved :meth:`state_dict` (ignored under a fixed schedule).

        Raises:
            ValueError: ``sample_interval`` is not an int >= 1.
        """
        interval = state.get("sample_interval")
        if interval is None:
            return
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"state['sample_interval'] must be an int >= 1, got {interval!r}")
        if self.pacer is not None:
            self.pacer.resume(interval)
