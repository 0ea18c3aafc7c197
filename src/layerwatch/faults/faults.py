"""Faults: NaN/Inf gradients, found between samples, and the module that made them named.

:class:`Faults` keeps the NaN sentinel's cadence and acts on what it finds:

- the sentinel (:mod:`~layerwatch.faults.sentinel`): its check is enqueued each step and read when it
  has landed (:meth:`Faults.check`); what it finds is a fault unless the optimizer then skipped
  the step (a GradScaler's overflow);
- a fault found before the optimizer step is replayed (:class:`~layerwatch.faults.step_replay.StepReplay`:
  the step's batch run again with every probe armed, to name the module that made it, the ranks
  of a DDP run agreeing first that each can, and sharing what they found);
- in a run whose ranks vote (sharded, or pipeline stages), the finding rides on the vote
  (:meth:`unvoted`, :meth:`on_voted`), and every rank acts on it a step later;
- what is said (its text: :mod:`~layerwatch.faults.messages`): the finding's warning, and at the
  next sample the offender, or what a module seen after an unreplayed fault is (never "the first offender").
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from layerwatch.health.alert import Alert
from layerwatch.distributed.agreement import Decision
from layerwatch.distributed.sharding import Layout, is_writer_rank, local
from layerwatch.guards.failures import FailurePolicy
from layerwatch.options import Options
from layerwatch.probes import Offender, ProbeResult, StepProbes
from layerwatch.faults import messages
from layerwatch.faults.step_replay import StepReplay
from layerwatch.faults.sentinel import Finding, NonfiniteSentinel, StepCounter
from layerwatch.measure.zero import Zero

logger = logging.getLogger("layerwatch")

Params = list[tuple[str, nn.Parameter]]


class Faults:
    """The sentinel's findings and what follows them, for one engine.

    Args:
        options: The validated options (``sentinel``, ``families``).
        failures: Where a failure is warned about.
        probes: The engine's probes: a replay arms them all.
        counter: The optimizers' step count, whether a step was skipped.
        write_fault: Writes a fault's first step to rank 0's sinks at once (``Output.write_fault``).
        ask_sample: Asks for the next step to be sampled.
    """

    def __init__(self, options: Options, failures: FailurePolicy, probes: StepProbes, counter: StepCounter,
                 write_fault: Callable[[int, int], None], ask_sample: Callable[[], None]) -> None:
        self.options = options
        self.failures = failures
        self._probes, self._counter, self._write_fault, self._ask_sample = probes, counter, write_fault, ask_sample
        self.step_replay = StepReplay(options, failures, probes)  # the open step's batches, and their replay
        self.sentinel: Optional[NonfiniteSentinel] = None
        self._zero: Optional[Zero] = None
        self._voting = False  # the ranks vote on each step: a finding waits for the vote
        self.step = 0  # the open step
        self._checked = False  # the sentinel checked the open step before its optimizer step
        self._watching: Optional[Params] = None  # the list the sentinel's shares were made from
        self._watched: Optional[list[tuple[Any, ...]]] = None  # what was in it then (_watched_key)
        self._spread = 1  # the steps the sentinel's check is spread over (the overhead budget's)
        self._measured = True  # the budget measured the checks within their share (or there is no budget)
        self.check_s = 0.0  # the sentinel's host time in the open step
        self._finding: Optional[Finding] = None  # this rank's, until the ranks have voted on it
        self._finding_voted = False
        self._offender_found = False
        # The step of a fault no probe saw happen (later offenders are then what came after
        # it, never "the first offender"); whether the weights held NaN/Inf by then: replay.fault_before.
        self.fault_step: Optional[int] = None
        self._reported: Optional[Finding] = None  # the finding _on_nonfinite said, once

    def start(self, model: Callable[[], Optional[nn.Module]], layout: Layout, zero: Optional[Zero],
              within: Optional[nn.Module], voting: bool, staged: bool) -> None:
        """The run's model (weakly held), where its parameters live, the module it is wrapped in,
        and whether its ranks vote (``staged``: they are pipeline stages)."""
        self._zero, self._voting = zero, voting
        self.step_replay.start(model, layout, within, messages.voting_hint(staged, layout.sharded) if voting else None)
        if self.options.sentinel:  # every rank: its shards, or (DDP) the same gradients, so the same findings
            self.sentinel = NonfiniteSentinel()

    def describe_replay(self, unreplayable: Optional[str] = None, differs: Optional[str] = None) -> None:
        """The front door's words of its replay: why a fault's step cannot be replayed, what a replay runs differently."""
        self.step_replay.describe(unreplayable, differs)

    def track(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """A replay puts these optimizers' gradients back too."""
        self.step_replay.track(optimizers)

    def tracked(self) -> list[Optional[torch.optim.Optimizer]]:
        """The optimizers tracked (None: one gone)."""
        return self.step_replay.tracked()

    def close(self) -> None:
        self.sentinel, self._watching, self._watched = None, None, None
        self.step_replay.close()

    def open(self, step: int, spread: int = 1, measured: bool = True) -> None:
        """Step ``step`` opens; the sentinel's check is spread over ``spread`` steps; ``measured``:
        the overhead budget has measured the checks (or there is no budget)."""
        self.step, self._measured = step, measured
        if self.step_replay.micro_batches:  # left by a step that did not end
            self.step_replay.let_go()
        self._checked, self.check_s = False, 0.0
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
            self.step_replay.offer(closure)

    def replay_spike(self, index: int) -> Optional[tuple[ProbeResult, float]]:
        """Run micro-batch ``index`` of the open step again with every probe armed (see :meth:`StepReplay.spike`)."""
        return self.step_replay.spike(self.step, index)

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
        step not checked before is checked now, the checks that have landed are read, and the
        step's micro-batches are let go of."""
        sentinel = self.sentinel
        try:
            if sentinel is None:
                return None
            started = time.perf_counter()
            try:
                return self._check(sentinel, params, before_optimizer_step)
            finally:
                self.check_s += time.perf_counter() - started
        finally:
            if not before_optimizer_step and self.step_replay.micro_batches:  # the step ends: its batches are let go of
                self.step_replay.let_go()

    def _check(self, sentinel: NonfiniteSentinel, params: Callable[[], Params],
               before_optimizer_step: bool) -> Optional[tuple[ProbeResult, float]]:
        step = self.step
        # Waiting for a check that lands later is a device sync a step: only once the budget measured the checks
        # within their share (it measures the waits too from then on, and spreads the check when they cost more).
        may_wait = sentinel.lands_later is False or (self._measured and self._spread == 1)
        replayable = before_optimizer_step and bool(self.step_replay.micro_batches) and may_wait
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
        skipped = None if before_optimizer_step or self._zero is None else _skipped_by_deepspeed(self._zero, step)
        findings += [skipped] if skipped is not None else []
        for finding in findings:
            if finding.stepped is False:
                logger.info("%s", messages.scaler_skip(finding.step))
                continue
            if self._voting:  # the ranks act on it together, once they have voted
                self._finding = self._finding or finding
                return None
            self.sentinel = None  # before the replay: nothing in it checks again
            if replayable and finding.step == step:
                replayed = self.step_replay.replay(step, lambda: self._on_nonfinite(finding, None))
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
                    self.failures.say(messages.spread_message(sentinel.rotation, sentinel.lands_later))
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

    # ------------------------------------------------------------------ what is said

    def _on_nonfinite(self, finding: Finding, sampled_step: Optional[int]) -> None:
        """The sentinel's first hit: the step, and a warning saying what comes next: the
        replay of that step (``sampled_step`` None), or every probe armed at ``sampled_step``."""
        self._reported = finding
        if not is_writer_rank():
            return
        message = messages.nonfinite_message(finding, sampled_step, self.step, self._probes.sees_nonfinite,
                                             self.step_replay.fault_before, self._unreplayed())
        self._write_fault(finding.step, self.step)
        logger.warning("layerwatch: %s", message)
        self.failures.warn(f"layerwatch: {message}")

    def offender_alerts(self, step: int, probes: Optional[ProbeResult], stepped: Optional[bool]) -> tuple[list[Alert], Optional[Offender]]:
        """What the probes' first offender says of sampled ``step``: its alert (once a run), and
        the offender when the probes saw the NaN appear (this step, or its batch replayed)."""
        offender = None if probes is None else probes.offender
        user = None if probes is None else probes.weight_user
        if offender is not None and offender.replayed_from is None and stepped is False:
            logger.info("%s", messages.offender_scaler_skip(step, offender))
            return [], None
        if (offender or user) is None or self._offender_found:
            return [], None
        self._offender_found = True  # raised before the rules, whose alert on the same layer says less
        named = None
        if offender is None:
            message = messages.weight_user(step, user, probes.nonfinite_weights, self.fault_step, self.step_replay.fault_before,
                                           self.options.sentinel, self._unreplayed())
        elif offender.replayed_from is None and self.fault_step is not None and step > self.fault_step:
            message = messages.after_fault(step, offender, self.fault_step, self.step_replay.fault_before, self._unreplayed())
        else:
            named = offender
            message = messages.first_offender(step, offender)
        return [Alert("nonfinite", (offender or user).name, step, message)], named

    def _unreplayed(self) -> str:
        """Why the fault's step was not replayed: the front door's words, or what the engine knows."""
        return messages.unreplayed(self.step_replay.hint, self.step_replay.offered)


def _watched_key(params: Params) -> list[tuple[Any, ...]]:
    """What the sentinel's shares of ``params`` are made from: each tensor, its name, whether it is
    frozen, its device and dtype. A sample walks the parameters again; where this is the same,
    the shares need not be made again (their work is per tensor)."""
    return [(n, id(p), p.requires_grad, p.device, p.dtype) for n, p in params]


def _skipped_by_deepspeed(zero: Zero, step: int) -> Optional[Finding]:
    """A finding when DeepSpeed skipped ``step``, its averaged gradients not finite: a fault in fp32
    and bf16; under fp16's dynamic loss scale an expected overflow (not a fault)."""
    expected = zero.skip_expected()
    if expected is None:
        return None
    return Finding(step, [], not expected, True, seen_by="DeepSpeed found their norm not finite and skipped the step")
