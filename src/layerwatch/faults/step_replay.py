"""The bad step's replay, decided and agreed on: the open step's micro-batches as offered, whether
the step can be replayed, and, in a DDP run, the ranks agreeing that each can before any replays,
then sharing what each found.

:class:`StepReplay` keeps what a replay needs (the micro-batches, the optimizers whose gradients
it puts back, the module the model is wrapped in) and why a fault's step was not replayed (the
front door's words, or the replay's own); the running itself is :func:`~layerwatch.faults.replay.replay_until_named`.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from layerwatch.distributed.agreement import RankSync
from layerwatch.distributed.sharding import Layout, is_writer_rank, local, world_size
from layerwatch.faults import messages
from layerwatch.faults.replay import MicroBatch, RngState, replay_until_named
from layerwatch.stats.norms import nonfinite_names
from layerwatch.guards.failures import FailurePolicy
from layerwatch.options import Options
from layerwatch.probes import Offender, ProbeResult, StepProbes
from layerwatch.probes.selection import is_compiled
from layerwatch.vocabulary import Family

REPLAY_GATHER_TIMEOUT_S = 300.0  # how long the ranks of a DDP run wait for each other's replay

Named = Optional[tuple[int, ProbeResult]]  # the micro-batch whose probes named the offender, and their result
Mine = Optional[tuple[int, str, str]]  # what a rank shares of it: the micro-batch, the offender's name and phase


class StepReplay:
    """The open step's offered micro-batches, and their replay with every probe armed.

    Args:
        options: The validated options (``families``).
        failures: Where a failure is warned about.
        probes: The engine's probes: a replay arms them all.
    """

    def __init__(self, options: Options, failures: FailurePolicy, probes: StepProbes) -> None:
        self.options, self.failures, self._probes = options, failures, probes
        self._model: Callable[[], Optional[nn.Module]] = lambda: None
        self._layout = Layout()
        self._within: Callable[[], Optional[nn.Module]] = lambda: None  # weakly held, as the model
        self._optimizers: list[Any] = []  # weak references: whose gradients a replay puts back too
        self.micro_batches: list[MicroBatch] = []  # the open step's (offer)
        self.offered = False  # offer() kept a micro-batch in this run
        # Why a fault's step was not replayed, in the front door's words or the replay's (None: it
        # can replay, or no one said; see messages.unreplayed), and what a replay runs differently
        # from the step (the front door's words), or "".
        self.hint: Optional[str] = None
        self.note = ""
        self.fault_before = False  # the weights held NaN/Inf as the bad step was to be replayed

    def start(self, model: Callable[[], Optional[nn.Module]], layout: Layout, within: Optional[nn.Module],
              hint: Optional[str] = None) -> None:
        """The run's model (weakly held), where its parameters live, the module it is wrapped in,
        and why a fault's step is never replayed in this run (None: it may be)."""
        self._model, self._layout = model, layout
        self._within = (lambda: None) if within is None else weakref.ref(within)
        self.hint = self.hint if hint is None else hint

    def describe(self, unreplayable: Optional[str] = None, differs: Optional[str] = None) -> None:
        """The front door's words: why a fault's step cannot be replayed, what a replay runs differently."""
        self.hint = self.hint if unreplayable is None else unreplayable
        self.note = self.note if differs is None else differs

    def track(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """A replay puts these optimizers' gradients back too (weakly held)."""
        self._optimizers += [weakref.ref(optimizer) for optimizer in optimizers]

    def tracked(self) -> list[Optional[torch.optim.Optimizer]]:
        """The optimizers tracked, in order (None: one gone)."""
        return [ref() for ref in self._optimizers]

    def offer(self, closure: Callable[[], Any]) -> None:
        """A micro-batch of the open step: ``closure()`` computes its loss again, from the RNG state noted now."""
        self.offered = True
        self.micro_batches.append(MicroBatch(closure, RngState.capture()))

    def let_go(self) -> None:
        """The open step's micro-batches are let go of (its end, or the next step's start)."""
        self.micro_batches = []

    def close(self) -> None:
        self.micro_batches, self._optimizers, self._within = [], [], lambda: None

    # ------------------------------------------------------------------ the replay of a fault

    def replay(self, step: int, report: Callable[[], None]) -> Optional[tuple[ProbeResult, float]]:
        """Run open step ``step``'s micro-batches again with every probe armed, before its optimizer
        step (see faults/replay.py); ``report()`` says the finding first. Returns what the probes saw, with
        the module named, and the seconds it took; None when no module was named.

        In a DDP run every rank gets here at the same step (they check the same synchronized
        gradients). The replay may issue collectives of its own (the closure's DDP forward,
        SyncBatchNorm), so the ranks first agree that every one of them can replay; then each
        replays its own batch, and they share what they found."""
        model = self._model()
        can = self._can(model, step)
        started = time.perf_counter()
        if world_size() > 1:
            found, ran, ranks = self.failures.run("replay the bad step on every rank", lambda: self._on_every_rank(
                model, step, report, can), step, otherwise=(None, False, []))
        elif can:
            found, ran = self._replay_here(model, step, report)
            ranks = [_mine(found)]
        else:
            found, ran, ranks = None, False, []
        rank = next((r for r, found_there in enumerate(ranks) if found_there is not None), None)
        if rank is None:
            self._named_nothing(step, ran, ranks)
            return None
        index, name, phase = ranks[rank]
        offender = Offender(name, phase, replayed_from=step,
                            replayed_what=messages.replayed_what(index, len(self.micro_batches), rank))
        result = ProbeResult([], None) if found is None else found[1]
        return dataclasses.replace(result, offender=offender), time.perf_counter() - started

    def _can(self, model: Optional[nn.Module], step: int) -> bool:
        """Whether this rank can replay the step: a model the probes can see inside, their NaN/Inf
        family on, the step not sampled already (its probes see it happen), and its weights finite."""
        unseeable = _unseeable(model)
        if unseeable:
            self.hint = messages.COMPILED_HINT
        can = (model is not None and not unseeable and Family.NONFINITE in self.options.families
               and self._probes.runtime_on
               and not self._probes.sees_nonfinite)  # sees it: sampled, saw it happen
        if not can:
            return False
        # weights NaN/Inf already: the fault came earlier, and a replay would name their first user
        bad = self.failures.run("look for NaN/Inf weights", lambda: _nonfinite(self._layout.parameters(model)), step,
                                otherwise=[])
        self.fault_before = bool(bad)
        return not bad

    def _on_every_rank(self, model: Optional[nn.Module], step: int, report: Callable[[], None],
                       can: bool) -> tuple[Named, bool, list[Mine]]:
        """Every rank of a DDP run: agree that each can replay, replay, and share what each found."""
        with RankSync(REPLAY_GATHER_TIMEOUT_S) as sync:
            if not all(sync.all(can)):
                return None, False, []
            found, ran = self._replay_here(model, step, report)
            return found, ran, list(sync.all(_mine(found)))

    def _replay_here(self, model: nn.Module, step: int, report: Callable[[], None]) -> tuple[Named, bool]:
        """This rank's replay, the finding said first: what named the offender, and whether the
        replay ran to its end (else its failure was warned about)."""
        self.failures.run("report NaN/Inf gradients", report, step)
        ran = self.failures.run(f"replay step {step}'s batch", lambda: (self._run_again(model, step),), step)
        return (None, False) if ran is None else (ran[0], True)

    def _named_nothing(self, step: int, ran: bool, ranks: list[Mine]) -> None:
        """A replay that named no module (``ranks``: what each rank found, empty when none replayed)."""
        if ranks:  # what a later sample's message says of the fault
            self.hint = messages.replayed_nothing_hint(step, ran)
        if ranks and is_writer_rank():
            self.failures.warn(messages.replay_fruitless(step, ran, self.note))

    def _run_again(self, model: nn.Module, step: int, only: Optional[int] = None) -> Named:
        """The micro-batches replayed until one's probes name an offender (faults/replay.py): its index
        and their result; None when none did (``only``: that micro-batch alone, and its result)."""
        within = self._within()
        beyond = [p for optimizer in self.tracked() if optimizer is not None
                  for group in optimizer.param_groups for p in group["params"]]
        return replay_until_named(
            model, self.micro_batches, self._probes, step, writer=is_writer_rank(),
            params=[p for _, p in self._layout.parameters(model)], within=within,
            also=beyond + ([] if within is None else list(within.parameters())), copy_gradients=world_size() > 1,
            only=only,
        )

    def spike(self, step: int, index: int) -> Optional[tuple[ProbeResult, float]]:
        """Run micro-batch ``index`` of open step ``step`` again with every probe armed (the one with
        the largest loss of a step whose loss spiked) in a single process: what the probes saw and
        the seconds it took; None where it cannot be (no runtime probe, or ranks that must agree first)."""
        model, started = self._model(), time.perf_counter()
        if model is None or world_size() > 1 or not self._probes.runtime_on or index >= len(self.micro_batches) or _unseeable(model):
            return None
        found = self.failures.run(f"replay step {step}'s batch", lambda: self._run_again(model, step, index), step)
        return None if found is None else (found[1], time.perf_counter() - started)


def _mine(found: Named) -> Mine:
    """What a rank shares of its replay: the micro-batch that named the offender, its name and phase."""
    return None if found is None else (found[0], found[1].offender.name, found[1].offender.phase)


def _unseeable(model: Optional[nn.Module]) -> bool:
    """A compiled model that this torch (before 2.6: no ``set_stance``) cannot run eagerly for the probes to see inside."""
    return model is not None and is_compiled(model) and not hasattr(torch.compiler, "set_stance")


def _nonfinite(params: Sequence[tuple[str, nn.Parameter]]) -> list[str]:
    """The parameters whose values (this rank's) hold NaN/Inf."""
    return nonfinite_names([(name, local(p)) for name, p in params])
