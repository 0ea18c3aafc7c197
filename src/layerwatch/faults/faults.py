"""Faults: NaN/Inf gradients, found between samples, and the module that made them named.

:class:`Faults` owns everything a NaN sets going:

- the sentinel (:mod:`~layerwatch.faults.sentinel`): its check is enqueued each step and read when it
  has landed (:meth:`Faults.check`); what it finds is a fault unless the optimizer then skipped
  the step (a GradScaler's overflow);
- the replay (:mod:`~layerwatch.faults.replay`): a fault found before the optimizer step runs the
  step's batch again with every probe armed, to name the module that made it, the ranks of a
  DDP run agreeing first that each can, and sharing what they found;
- in a run whose ranks vote (sharded, or pipeline stages), the finding rides on the vote
  (:meth:`unvoted`, :meth:`on_voted`), and every rank acts on it a step later;
- what is said: the finding's warning, and at the next sample the offender, or what a module
  seen after an unreplayed fault is (never "the first offender").
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from layerwatch.sinks import record as R
from layerwatch.health.alert import Alert
from layerwatch.distributed.agreement import Decision, RankSync
from layerwatch.distributed.sharding import Layout, is_writer_rank, local, world_size
from layerwatch.guards.failures import FailurePolicy
from layerwatch.options import Options
from layerwatch.engine.output import Output
from layerwatch.probes import Offender, ProbeResult, StepProbes
from layerwatch.probes.selection import is_compiled
from layerwatch.faults.replay import MicroBatch, RngState, replay_until_named
from layerwatch.faults.sentinel import Finding, NonfiniteSentinel, StepCounter, nonfinite_names
from layerwatch.measure.zero import Zero

logger = logging.getLogger("layerwatch")

REPLAY_GATHER_TIMEOUT_S = 300.0  # how long the ranks of a DDP run wait for each other's replay

Params = list[tuple[str, nn.Parameter]]


class Faults:
    """The sentinel's findings and what follows them, for one engine.

    Args:
        options: The validated options (``sentinel``, ``families``).
        failures: Where a failure is warned about.
        probes: The engine's probes: a replay arms them all.
        counter: The optimizers' step count, whether a step was skipped.
        output: Rank 0's sinks: a finding's record goes there at once.
        ask_sample: Asks for the next step to be sampled.
    """

    def __init__(self, options: Options, failures: FailurePolicy, probes: StepProbes, counter: StepCounter,
                 output: Output, ask_sample: Callable[[], None]) -> None:
        self.options = options
        self.failures = failures
        self._probes, self._counter, self._output, self._ask_sample = probes, counter, output, ask_sample
        self.sentinel: Optional[NonfiniteSentinel] = None
        self._model: Callable[[], Optional[nn.Module]] = lambda: None
        self._layout = Layout()
        self._zero: Optional[Zero] = None
        self._voting = False  # the ranks vote on each step: a finding waits for the vote
        self._within: Callable[[], Optional[nn.Module]] = lambda: None  # weakly held, as the model
        self.optimizers: list[Any] = []  # weak references: whose gradients a replay puts back too
        self.step = 0  # the open step
        # The open step's micro-batches (replay_with), and whether the sentinel checked this
        # step before its optimizer step.
        self.micro_batches: list[MicroBatch] = []
        self._checked = False
        self._watching: Optional[Params] = None  # the list the sentinel's shares were made from
        self._watched: Optional[list[tuple[Any, ...]]] = None  # what was in it then (_watched_key)
        self._spread = 1  # the steps the sentinel's check is spread over (the overhead budget's)
        self._measured = True  # the budget measured the checks within their share (or there is no budget)
        self.check_s = 0.0  # the sentinel's host time in the open step
        self._finding: Optional[Finding] = None  # this rank's, until the ranks have voted on it
        self._finding_voted = False
        self._offender_found = False
        # The step of a fault no probe saw happen (later offenders are then what came after
        # it, never "the first offender"), and whether the weights held NaN/Inf by then.
        self.fault_step: Optional[int] = None
        self._fault_before = False
        self._reported: Optional[Finding] = None  # the finding _on_nonfinite said, once
        # Why a fault's step was not replayed, in the front door's words (None: the door can replay,
        # or did not say; see _unreplayed)
        self.replay_hint: Optional[str] = None
        self._replay_offered = False  # offer() was called in this run
        self.replay_note = ""  # what a replay runs differently from the step (the front door's words), or ""

    def start(self, model: Callable[[], Optional[nn.Module]], layout: Layout, zero: Optional[Zero],
              within: Optional[nn.Module], voting: bool, staged: bool) -> None:
        """The run's model (weakly held), where its parameters live, the module it is wrapped in,
        and whether its ranks vote (``staged``: they are pipeline stages)."""
        self._model, self._layout, self._zero, self._voting = model, layout, zero, voting
        self._within = (lambda: None) if within is None else weakref.ref(within)
        if self.options.sentinel:  # every rank: its shards, or (DDP) the same gradients, so the same findings
            self.sentinel = NonfiniteSentinel()
        if voting:
            self.replay_hint = (f"a {'pipelined' if staged else 'sharded'} run's ranks agree on a finding "
                                "a step later, after the optimizer step, so the bad step is not replayed")

    def close(self) -> None:
        self.sentinel, self._watching, self._watched = None, None, None
        self.micro_batches, self.optimizers, self._within = [], [], lambda: None

    def open(self, step: int, spread: int = 1, measured: bool = True) -> None:
        """Step ``step`` opens; the sentinel's check is spread over ``spread`` steps; ``measured``:
        the overhead budget has measured the checks (or there is no budget)."""
        self.step, self._measured = step, measured
        self.micro_batches, self._checked, self.check_s = [], False, 0.0
        if spread != self._spread:
            self._spread, self._watching, self._watched = spread, None, None  # shares made anew at the next check

    def offer(self, closure: Callable[[], Any], voting: bool, keep: bool = False) -> None:
        """The open step may be replayed: ``closure()`` computes the loss of this step's batch
        again (a micro-batch's, with gradient accumulation: one closure per micro-batch), and
        is offered before that forward, so that the RNG state it starts from is noted.

        When the sentinel finds NaN/Inf gradients at this step, :meth:`check` (before the
        optimizer step) runs each closure again, with every probe armed and fresh gradients,
        and calls ``backward()`` on what it returns (a loss tensor, or a mapping with a
        ``"loss"``), to name the module that made the NaN. RNG states, buffers, gradients and
        module modes are restored after it (see :mod:`~layerwatch.faults.replay`). Nothing is kept
        past the step. Not taken when the ranks vote (``voting``): they agree on a finding a
        step later. ``keep``: kept whatever the sentinel does (a loss spike replays the step
        too: :meth:`replay_spike`)."""
        if (self.sentinel is not None or keep) and not voting:
            self._replay_offered = True
            self.micro_batches.append(MicroBatch(closure, RngState.capture()))

    # ------------------------------------------------------------------ the sentinel

    def check(self, params: Callable[[], Params], before_optimizer_step: bool = False) -> Optional[tuple[ProbeResult, float]]:
        """Enqueue a check of the gradients (of ``params()``); act on the checks that have landed.
        Returns what a replay of the open step saw, and the seconds it took, when it named the
        module: the step is then sampled with it.

        ``before_optimizer_step``: the gradients are those the optimizer steps with (every door
        gets here; some loops clear them before the step ends, as the Hugging Face Trainer
        does), so this step's check is enqueued here. When the step can be replayed it is read
        at once (on a GPU, a sync) and a finding replays it: the optimizer steps after this (a
        door offers no replay where a GradScaler may skip the step). At the end of the step, a
        step not checked before is checked now, and the checks that have landed are read."""
        sentinel = self.sentinel
        if sentinel is None:
            return None
        started = time.perf_counter()
        try:
            return self._check(sentinel, params, before_optimizer_step)
        finally:
            self.check_s += time.perf_counter() - started

    def _check(self, sentinel: NonfiniteSentinel, params: Callable[[], Params],
               before_optimizer_step: bool) -> Optional[tuple[ProbeResult, float]]:
        step = self.step
        # Waiting for a check that lands later is a device sync a step: only once the budget measured the checks
        # within their share (it measures the waits too from then on, and spreads the check when they cost more).
        may_wait = sentinel.lands_later is False or (self._measured and self._spread == 1)
        replayable = before_optimizer_step and bool(self.micro_batches) and may_wait
        if before_optimizer_step:
            stepped: Optional[bool] = True if replayable else None  # else settled at the end of the step
        else:
            stepped = self._counter.stepped_since_last_check()
            sentinel.settle(step, stepped)
        if before_optimizer_step or not self._checked:
            self._checked = True
            try:
                self._enqueue(sentinel, params(), step, stepped)
            except Exception as e:  # an inspector must never break the training run
                self.failures.failed("check the gradients for NaN/Inf", e, step)
        if before_optimizer_step and not replayable:
            return None
        findings = sentinel.poll(wait=replayable, at_hand=step if replayable else None)
        skipped = None if before_optimizer_step or self._zero is None else self._zero.skipped_finding(step)
        findings += [skipped] if skipped is not None else []
        for finding in findings:
            if finding.stepped is False:
                logger.info("layerwatch: step %d: NaN/Inf gradients and no optimizer step (a GradScaler skip)", finding.step)
                continue
            if self._voting:  # the ranks act on it together, once they have voted
                self._finding = self._finding or finding
                return None
            self.sentinel = None  # before the replay: nothing in it checks again
            if replayable and finding.step == step:
                replayed = self._replay(finding)
                if replayed is not None:
                    return replayed
            self.fault_step = finding.step
            self._ask_sample()
            if self._reported is not finding:  # a replay that named nothing has said it already
                self.failures.run("report NaN/Inf gradients", lambda: self._on_nonfinite(finding, step + 1), step)
            return None
        return None

    def _enqueue(self, sentinel: NonfiniteSentinel, params: Params, step: int, stepped: Optional[bool]) -> None:
        if self._zero is not None:  # the group DeepSpeed steps now: its averaged gradient partition, this rank's
            sentinel.check(step, self._zero.flat_gradients(), stepped)
            return
        if self._watching is not params:  # walked again at a sample, or spread anew
            self._watching, watched = params, _watched_key(params)
            if watched != self._watched:  # other tensors (FSDP swaps them), moved, or a new spread: new shares
                self._watched = watched
                before = sentinel.rotation
                sentinel.watch(params, local, self._spread)
                if self._spread > 1 and sentinel.rotation > before and is_writer_rank():
                    self.failures.say(spread_message(sentinel.rotation, sentinel.lands_later))
        sentinel.check_next(step, stepped)

    def unvoted(self) -> Optional[Finding]:
        """This rank's finding, for its ballot, until the ranks have voted on one."""
        return None if self._finding_voted else self._finding

    def on_voted(self, decision: Decision, step: int) -> None:
        """A rank's sentinel found NaN/Inf gradients, and every rank knows it now: none checks
        again, ``step`` is sampled, and rank 0 reports it (with the tensors, when its own
        shards held them)."""
        if self._finding_voted:
            return
        self._finding_voted = True
        self.fault_step = decision.finding_step
        own, self._finding = self._finding, None
        if is_writer_rank():
            mine = own is not None and own.step == decision.finding_step
            rotation = 1 if self.sentinel is None else self.sentinel.rotation
            finding = Finding(decision.finding_step, own.tensors if mine else [], None, decision.finding_nan, rotation,
                              own.seen_by if mine else "", unnamed=mine and own.unnamed)
            self.failures.run("report NaN/Inf gradients", lambda: self._on_nonfinite(finding, step), step)
        self.sentinel = None

    # ------------------------------------------------------------------ the replay

    def _replay(self, finding: Finding) -> Optional[tuple[ProbeResult, float]]:
        """Run the open step's micro-batches again with every probe armed, before its optimizer
        step (see replay.py). Returns what the probes saw, with the module named, and the
        seconds it took; None when no module was named.

        In a DDP run every rank gets here at the same step (they check the same synchronized
        gradients). The replay may issue collectives of its own (the closure's DDP forward,
        SyncBatchNorm), so the ranks first agree that every one of them can replay; then each
        replays its own batch, and they share what they found."""
        model = self._model()
        step = self.step
        unseeable = _unseeable(model)
        if unseeable:
            self.replay_hint = ("the model is compiled, and this torch (before 2.6) cannot run it eagerly for the "
                                "probes to see inside, so it is not replayed")
        can = (model is not None and not unseeable and "nonfinite" in self.options.families
               and self._probes.runtime_on
               and not self._probes.sees_nonfinite)  # sees it: sampled, saw it happen
        if can:  # weights NaN/Inf already: the fault came earlier, and a replay would name their first user
            bad: list[str] = []
            self.failures.run("look for NaN/Inf weights", lambda: bad.extend(_nonfinite(self._layout.parameters(model))), step)
            self._fault_before, can = bool(bad), not bad
        found: list[Optional[tuple[int, ProbeResult]]] = [None]  # the micro-batch that named it, and its probes
        ranks: list[Any] = []
        ran = [False]  # the replay ran to its end here (else its failure was warned about)
        started = time.perf_counter()

        def run_again() -> bool:
            found[0] = self._run_again(model)
            return True

        def replay_here() -> None:
            self.failures.run("report NaN/Inf gradients", lambda: self._on_nonfinite(finding, None), step)
            ran[0] = self.failures.run(f"replay step {step}'s batch", run_again, step, otherwise=False)

        def mine() -> Any:
            return None if found[0] is None else (found[0][0], found[0][1].offender.name, found[0][1].offender.phase)

        def on_every_rank() -> None:
            with RankSync(REPLAY_GATHER_TIMEOUT_S) as sync:
                if all(sync.all(can)):
                    replay_here()
                    ranks.extend(sync.all(mine()))

        if world_size() > 1:
            self.failures.run("replay the bad step on every rank", on_every_rank, step)
        elif can:
            replay_here()
            ranks.append(mine())
        rank = next((r for r, found_there in enumerate(ranks) if found_there is not None), None)
        if rank is None:
            if ranks:  # what a later sample's message says of the fault
                self.replay_hint = f"step {step}'s batch, run again, {'made no NaN/Inf' if ran[0] else 'could not be run'}"
            if ranks and is_writer_rank():
                note = f"; {self.replay_note}" if self.replay_note else ""
                what = ("made no NaN/Inf (the fault is outside what the replay runs, or does not happen again" if ran[0]
                        else "could not be run again (said above")
                self.failures.warn(f"layerwatch: step {step}'s batch, run again with every probe armed, {what}{note}); "
                                   "the next step is sampled instead")
            return None
        index, name, phase = ranks[rank]
        parts = ([f"micro-batch {index + 1} of {len(self.micro_batches)}"] if len(self.micro_batches) > 1 else []) + (
            [f"rank {rank}'s batch"] if rank != 0 else [])
        offender = Offender(name, phase, replayed_from=step, replayed_what=", ".join(parts))
        result = ProbeResult([], None) if found[0] is None else found[0][1]
        result.offender = offender
        return result, time.perf_counter() - started

    def _run_again(self, model: nn.Module, only: Optional[int] = None) -> Optional[tuple[int, ProbeResult]]:
        """The micro-batches replayed until one's probes name an offender (replay.py): its index
        and their result; None when none did (``only``: that micro-batch alone, and its result)."""
        within = self._within()
        beyond = [p for ref in self.optimizers if ref() is not None for group in ref().param_groups for p in group["params"]]
        return replay_until_named(
            model, self.micro_batches, self._probes, self.step, writer=is_writer_rank(),
            params=[p for _, p in self._layout.parameters(model)], within=within,
            also=beyond + ([] if within is None else list(within.parameters())), copy_gradients=world_size() > 1,
            only=only,
        )

    def replay_spike(self, index: int) -> Optional[tuple[ProbeResult, float]]:
        """Run micro-batch ``index`` of the open step again with every probe armed (the one with
        the largest loss of a step whose loss spiked) in a single process: what the probes saw and
        the seconds it took; None where it cannot be (no runtime probe, or ranks that must agree first)."""
        model, started, found = self._model(), time.perf_counter(), [None]
        if model is None or world_size() > 1 or not self._probes.runtime_on or index >= len(self.micro_batches) or _unseeable(model):
            return None
        self.failures.run(f"replay step {self.step}'s batch", lambda: found.__setitem__(0, self._run_again(model, index)), self.step)
        return None if found[0] is None else (found[0][1], time.perf_counter() - started)

    # ------------------------------------------------------------------ what is said

    def _on_nonfinite(self, finding: Finding, sampled_step: Optional[int]) -> None:
        """The sentinel's first hit: the step, and a warning saying what comes next: the
        replay of that step (``sampled_step`` None), or every probe armed at ``sampled_step``."""
        self._reported = finding
        if not is_writer_rank():
            return
        rec = R.build(finding.step, first_nonfinite_step=finding.step)
        where = _where(finding)
        overflow = "" if finding.nan else " (or finite gradients whose norm passes ~1.8e19: an explosion)"
        every = "every step" if finding.rotation == 1 else f"each gradient at least every {finding.rotation} steps"
        if sampled_step is None:
            then = "its batch is run again with every probe armed, before the optimizer step, to find the module that made it"
        elif finding.step == self.step and self._probes.sees_nonfinite:
            then = "this step is sampled with every probe armed, so they name the module that made it"
        else:
            which = "the next step" if sampled_step == self.step + 1 else f"step {sampled_step}"
            before = ("the weights held NaN/Inf already, so the fault came earlier, in gradients the sentinel had not "
                      "checked yet; " if self._fault_before else "")
            then = (f"{before}{which} is sampled with every probe armed; it shows what came after the fault, not the "
                    f"module that made it ({self._unreplayed()})")
        seen = f"(the sentinel, {every}){where}{overflow}" if not finding.seen_by else f"({finding.seen_by})"
        message = f"NaN/Inf gradients at step {finding.step} {seen}; {then}"
        self._output.emit(rec, self.step)
        logger.warning("layerwatch: %s", message)
        self.failures.warn(f"layerwatch: {message}")

    def _unreplayed(self) -> str:
        """Why the fault's step was not replayed: the front door's words, or what the engine knows."""
        if self.replay_hint is not None:
            return self.replay_hint
        if self._replay_offered:
            return "the sentinel saw it after the step it happened in had passed, so that step was not replayed"
        return "to find it, let layerwatch replay the bad step: Inspector.replay_with(closure) before each step's forward"

    def offender_alerts(self, step: int, probes: Optional[ProbeResult], stepped: Optional[bool]) -> tuple[list[Alert], Optional[Offender]]:
        """What the probes' first offender says of sampled ``step``: its alert (once a run), and
        the offender when the probes saw the NaN appear (this step, or its batch replayed)."""
        offender = None if probes is None else probes.offender
        user = None if probes is None else probes.weight_user
        if offender is not None and offender.replayed_from is None and stepped is False:
            logger.info("layerwatch: step %d: %s made a non-finite %s value and no optimizer step followed "
                        "(a GradScaler skip): not a fault", step, offender.name, offender.phase)
            return [], None
        if (offender or user) is None or self._offender_found:
            return [], None
        self._offender_found = True  # raised before the rules, whose alert on the same layer says less
        named = None
        if offender is None and self.fault_step is not None:
            when = f"{'before step' if self._fault_before else 'at step'} {self.fault_step}, between samples"
            message = _weights_came_first(step, user, probes.nonfinite_weights, when, self._unreplayed())
        elif offender is None:
            message = _weights_came_first(step, user, probes.nonfinite_weights, f"before step {step}, where no probe saw it",
                                          "the sentinel is off; with sentinel=True it is found at its step"
                                          if not self.options.sentinel else "the sentinel had not checked those gradients yet")
        elif offender.replayed_from is None and self.fault_step is not None and step > self.fault_step:
            message = self._after_fault(step, offender)
        else:
            named = offender
            message = "first offender: " + offender.describe(step)
        return [Alert("nonfinite", (offender or user).name, step, message)], named

    def _after_fault(self, step: int, offender: Offender) -> str:
        """What an offender seen after an unreplayed fault is: never "the first offender"."""
        when = "before step" if self._fault_before else "at step"
        return (f"first module with a non-finite {offender.phase} output at step {step}: {offender.name}. The fault "
                f"happened {when} {self.fault_step}, between samples; step {step} shows what came after it, which "
                f"need not be where it began ({self._unreplayed()})")

def _unseeable(model: Optional[nn.Module]) -> bool:
    """A compiled model that this torch (before 2.6: no ``set_stance``) cannot run eagerly for the probes to see inside."""
    return model is not None and is_compiled(model) and not hasattr(torch.compiler, "set_stance")


def _weights_came_first(step: int, user: Offender, weights: Sequence[str], when: str, how: str) -> str:
    """What a module that computed with a weight that was non-finite already is: it used the
    fault (which happened ``when``), the optimizer having carried it into the weights; it did
    not make it (``how``: why that module is not known)."""
    names = ", ".join(weights[:3]) + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")
    return (f"first module to use a non-finite weight at step {step}: {user.name} ({names} held NaN/Inf before "
            f"the step's forward). The fault happened {when}; the optimizer carried it into the weights, so the "
            f"module that made it is not known ({how})")


def _where(finding: Finding) -> str:
    """Where the warning says the NaN/Inf was: the gradients named, those a flag did not name, or another rank's."""
    names = ", ".join(finding.tensors[:5]) + (f" and {len(finding.tensors) - 5} more" if len(finding.tensors) > 5 else "")
    if finding.unnamed:
        return f"{f' in {names} and' if names else ' in'} this step's share of the gradients (its one flag names none)"
    return f" in {names}" if names else " in gradients (shards, or a pipeline stage's) held by another rank"


def _nonfinite(params: Sequence[tuple[str, nn.Parameter]]) -> list[str]:
    """The parameters whose values (this rank's) hold NaN/Inf."""
    return nonfinite_names([(name, local(p)) for name, p in params])


def spread_message(rotation: int, lands_later: bool) -> str:
    """The one line that says the overhead budget spread the sentinel's check, and what is lost."""
    waits = (" Nor is its check waited for before the optimizer step any more (there, a device sync a step), so "
             "no bad step is replayed." if lands_later else "")
    return ("layerwatch: the NaN sentinel's check took the host more than its share of the overhead budget, so it now "
            f"checks the gradients in turn, each at least every {rotation} steps: a NaN in one step's gradients outside "
            "that step's share is found when it reaches the weights, a step or more later, and that step is not "
            f"replayed; pass every_n_steps= to keep the check as it was.{waits}")


def _watched_key(params: Params) -> list[tuple[Any, ...]]:
    """What the sentinel's shares of ``params`` are made from: each tensor, its name, whether it is
    frozen, its device and dtype. A sample walks the parameters again; where this is the same,
    the shares need not be made again (their work is per tensor)."""
    return [(n, id(p), p.requires_grad, p.device, p.dtype) for n, p in params]
