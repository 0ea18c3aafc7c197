"""The engine every front door drives: what happens on a sampled step, and in which order.

A front door (``Inspector`` for a plain loop, ``InspectCallback`` for Lightning) calls this
small protocol, and nothing private::

    engine.start()
    for each optimizer step k:
        engine.begin_step(k)             # k sampled? then the module hooks are armed
        ...forward, backward...
        engine.before_optimizer_step()   # gradients are final: the NaN sentinel's check; read them,
                                         # snapshot the weights
        ...optimizer.step()...
        engine.after_optimizer_step()    # weights are final: update ratios, read them
        engine.end_step()                # the sentinel's findings; a sampled step is written
    engine.finish()

``state_dict()`` / ``load_state_dict()`` carry what a resumed run needs (the overhead budget's
interval); the front doors put it into their own state.

``before_optimizer_step`` and ``after_optimizer_step`` may be left out: ``end_step`` reads
whatever the step has not read yet. Off-steps cost a schedule lookup (and the sentinel's
fused check, when it is on). The data flow of a sampled step is one way: device rows
(:mod:`~layerwatch.params`, :mod:`~layerwatch.probes`) -> one transfer per device -> a
:class:`~layerwatch.record.StepRecord` -> the sinks.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch import record as R
from layerwatch import stats as S
from layerwatch.alerts import Alert, HealthCheck
from layerwatch.budget import Pacer
from layerwatch.distributed import (
    FAILED_NORM, Ballot, Decision, Layout, RankSync, StepVote, is_writer_rank, local, local_tensors, parameter_layout,
    world_size,
)
from layerwatch.failures import FailurePolicy
from layerwatch.hooks import Attachments, CollectorClock, claim
from layerwatch.options import Options, writable_dir
from layerwatch.params import ParameterFamilies, Piece, Snapshot
from layerwatch.probes import Offender, ProbeResult, StepProbes, probe_name, select_modules
from layerwatch.probes.selection import is_compiled
from layerwatch.replay import MicroBatch, RngState, forward_again, replay_until_named
from layerwatch.schedule import Schedule, every_n_steps
from layerwatch.sentinel import Finding, NonfiniteSentinel, StepCounter, nonfinite_names
from layerwatch.sinks.tensorboard import TensorBoardSink
from layerwatch.stages import Held, StagePart, Stages, find_stages
from layerwatch.table import Summary
from layerwatch.zero import Zero, engine_of, find_zero

logger = logging.getLogger("layerwatch")

EXCESS_LIMIT = 2.0  # see Engine._overhead_s
UNSHARED_INTERVAL = 50  # the interval of a distributed run whose ranks cannot share the budget's
REPLAY_GATHER_TIMEOUT_S = 300.0  # how long the ranks of a DDP run wait for each other's replay
logger.addHandler(logging.NullHandler())  # a library logs; the application decides where it goes


@dataclass
class _Sample:
    """What a sampled step has gathered so far: device tensors until ``end_step``."""

    step: int
    params: list[tuple[str, nn.Parameter]]
    steps_before: Optional[int]  # the optimizers' step count when it began (None: not counted)
    overhead_s: float = 0.0
    before_calls: int = 0  # before_optimizer_step calls that read something
    after_calls: int = 0
    grads: list[Piece] = field(default_factory=list)
    weights: list[Piece] = field(default_factory=list)
    update: list[Piece] = field(default_factory=list)
    update_estimate: list[Piece] = field(default_factory=list)  # from strided samples: the snapshot did not fit
    grads_read: set[int] = field(default_factory=set)  # id() of the parameters read so far
    weights_read: set[int] = field(default_factory=set)
    snapshots: list[tuple[Optional[int], Snapshot]] = field(default_factory=list)  # (id of the optimizer, ...)
    replay: Optional[ProbeResult] = None  # what the probes saw on the step's batch run again (replay.py)

    def unread(self, read: set[int], optimizer: Any,
               keep: Optional[list[tuple[str, nn.Parameter]]] = None) -> list[tuple[str, nn.Parameter]]:
        """The parameters (of ``optimizer``, or all; of ``keep`` only, when given) not read yet
        into ``read``; now marked read."""
        mine = None if optimizer is None else {id(p) for group in optimizer.param_groups for p in group["params"]}
        out = [(n, p) for n, p in (self.params if keep is None else keep)
               if id(p) not in read and (mine is None or id(p) in mine)]
        read.update(id(p) for _, p in out)
        return out


class Engine:
    """Samples a model's parameters and modules on a schedule and writes them to TensorBoard.

    Args:
        model: The module to watch. Held by weak reference.
        options: The validated options (:func:`~layerwatch.options.validate_options`).
        writer: A ``SummaryWriter`` to write into (flushed, never closed). Exclusive with
            ``log_dir``.
        log_dir: Directory for a ``SummaryWriter`` the engine owns and closes. With
            neither, ``SummaryWriter()``'s default ``runs/...`` directory.
        owner: The front door's name, as its messages spell it (``"Inspector"``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``writer`` lacks the
            ``SummaryWriter`` interface.
        ValueError: both ``writer`` and ``log_dir``, or a ``log_dir`` that cannot be written.
    """

    def __init__(
        self, model: nn.Module, options: Options, *, writer: Any = None, log_dir: Optional[str | os.PathLike] = None,
        owner: str = "Engine",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(options, Options):
            raise TypeError(f"options must be an Options from validate_options(), got {type(options).__name__}")
        if writer is not None and log_dir is not None:
            raise ValueError(f"pass writer or log_dir, not both (got writer={writer!r}, log_dir={str(log_dir)!r})")
        if writer is not None and not all(hasattr(writer, m) for m in ("add_scalar", "add_histogram_raw", "flush")):
            raise TypeError(f"writer must be a SummaryWriter, got {type(writer).__name__}")
        self.options = options
        self.owner = owner
        self.log_dir = None if log_dir is None else writable_dir(log_dir)
        self._model = weakref.ref(model)
        self._writer = writer
        self._extra_sinks: list[Callable[[R.StepRecord], None]] = []
        self._state = "new"
        self._step = 0
        self._sample: Optional[_Sample] = None
        self.failures = FailurePolicy()
        self._params = ParameterFamilies(options, self.failures)
        self._probes = StepProbes(options.families, options.modules, options.stats, options.bins, self.failures)
        self._health = None if options.rules is None else HealthCheck(options.rules, self.failures)
        self._counter = StepCounter()
        # What is attached to the user's objects lives apart from the engine and goes with it.
        self._attached = Attachments()
        self._collector = CollectorClock()
        self._attached.removables += [self._probes, self._counter, self._collector]
        self._release = weakref.finalize(self, self._attached.release)
        self._sentinel: Optional[NonfiniteSentinel] = None
        self._zero: Optional[Zero] = None  # a DeepSpeed ZeRO run's partitions (zero.py)
        self._force_sample = False
        # A sharded run (see distributed.py): every rank takes part in every sampled step, and
        # the ranks vote on which steps those are; a sentinel's finding waits for the vote.
        self._layout = Layout()
        self._sync: Optional[RankSync] = None
        self._vote: Optional[StepVote] = None
        self._stages: Optional[Stages] = None  # pipeline stages (stages.py): each rank measures its own, and votes too
        self._finding: Optional[Finding] = None
        self._finding_reported = False
        self._offender_found = False
        # The replay (replay.py): the open step's micro-batches, whether the sentinel checked
        # this step before its optimizer step, and the step of a fault no probe saw happen
        # (later offenders are then what came after it, never "the first offender").
        self._micro_batches: list[MicroBatch] = []
        self._sentinel_checked = False
        self._fault_step: Optional[int] = None
        self._within: Callable[[], Optional[nn.Module]] = lambda: None  # weakly held, as the model
        self._optimizers: list[Any] = []  # weak references: whose gradients a replay puts back too
        self._fault_before = False  # the weights held NaN/Inf when the sentinel found the fault
        self._reported: Optional[Finding] = None  # the finding _on_nonfinite said, once
        # Why a fault's step was not replayed, in the front door's words (None: the door can replay,
        # or did not say; see _unreplayed)
        self.replay_hint: Optional[str] = None
        self._replay_offered = False  # replay_with() was called in this run
        self.replay_note = ""  # what a replay runs differently from the step (the front door's words), or ""
        self._samples_written = 0
        self._schedule_checked = False
        # The overhead budget (budget.py), when it is the schedule: rank 0 chooses the interval
        # and every rank takes it from rank 0, at the steps it schedules (interval_sync).
        self._pacer = None if options.budget is None else Pacer(options.budget)
        self._schedule: Schedule | Pacer = options.schedule if self._pacer is None else self._pacer
        self._interval_sync: Optional[RankSync] = None
        self._proposed_interval: Optional[int] = None  # rank 0's choice at this step, not shared yet
        self._own_s = 0.0  # layerwatch's time in the open step, while it is unsampled
        self._last_off_own_s: Optional[float] = None  # the previous step's, when it was unsampled
        # Wall time of the open step since begin_step, and of recent unsampled steps: a sampled
        # step's cost beyond its neighbours' includes what no timer of ours sees (the module
        # hooks' dispatch in torch, the garbage collector, page faults).
        self._opened_at = 0.0
        self._off_steps: deque[float] = deque(maxlen=16)
        self._last_write_s = 0.0
        # The parameters as last walked (a walk costs per module: once, then at each sample),
        # and the list the sentinel's shares were made from.
        self._param_cache: Optional[list[tuple[str, nn.Parameter]]] = None
        self._sentinel_watching: Optional[list[tuple[str, nn.Parameter]]] = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def _sink(self) -> Optional[TensorBoardSink]:
        return self._attached.sink

    @_sink.setter
    def _sink(self, sink: Optional[TensorBoardSink]) -> None:
        self._attached.sink = sink

    @property
    def state(self) -> str:
        """``"new"``, then ``"running"`` from :meth:`start`, then ``"finished"`` from :meth:`finish`."""
        return self._state

    @property
    def schedule(self) -> Schedule | Pacer:
        """What chooses the sampled steps: the schedule given, or the overhead budget's pacer
        (its ``interval``)."""
        return self._schedule

    @property
    def alerts(self) -> list[Alert]:
        """Every health alert raised so far, in the order first seen (rank 0; empty elsewhere)."""
        return [] if self._health is None else self._health.monitor.alerts

    @property
    def current_step(self) -> int:
        """The step last opened by :meth:`begin_step`."""
        return self._step

    @property
    def sampled(self) -> bool:
        """Whether the open step is sampled."""
        return self._sample is not None

    def start(self, *, within: Optional[nn.Module] = None, compiled_by_caller: bool = False,
              deepspeed: Any = None) -> "Engine":
        """Open the writer (rank 0) and write the chart layout. Opens no step. A model still
        watched by an earlier engine that was never finished is taken from it: that engine
        is finished first (its hooks removed, its writer flushed).

        ``within``: a module the model is wrapped in, whose FSDP units may hold some of its
        parameters (Lightning's ``strategy="fsdp"`` wraps the LightningModule itself). In a
        distributed run, call it on every rank at the same point: a sharded run makes the
        ranks' group for agreeing here, which is collective.

        ``compiled_by_caller``: the caller will run the model under ``torch.compile`` (the Hugging
        Face Trainer's ``torch_compile=True``), so its modules get the traced probe's hooks now,
        before the first compiled forward.

        ``deepspeed``: the DeepSpeed engine (or its ZeRO optimizer) that trains the model, when
        the model is not that engine itself. A ``DeepSpeedEngine`` given as the model is watched
        through the module it trains; with ZeRO, every rank reads its partitions
        (:mod:`~layerwatch.zero`): the gradients in the step pre-hook of the optimizer DeepSpeed
        steps (:attr:`deepspeed_client`, which the front door hooks).
        """
        if self._state != "new":
            raise RuntimeError(f"start() called on an {self.owner.lower()} that is {self._state}")
        model = self._model()
        engine = None if model is None else engine_of(model)
        if engine is not None:  # watch the model it trains, under its own names
            model, deepspeed = engine.module, deepspeed or engine
            self._model = weakref.ref(model)
        previous = None if model is None else claim(model, self)
        if previous is not None and previous._state == "running":
            self.failures.warn(
                f"layerwatch: this {type(model).__name__} was still watched by an earlier {previous.owner} that "
                "was not finished (a cell run again?); that one is finished now, so its hooks do not stay on the model"
            )
            previous.finish()
        if model is not None and world_size() > 1:
            zero: list[Optional[Zero]] = []
            self.failures.run("find DeepSpeed ZeRO's partitions", lambda: zero.append(
                find_zero(model, deepspeed, self.options.families, self.failures)), 0)
            self._zero = zero[0] if zero else None
        self._layout = parameter_layout(model, within, self._zero)
        self._params.layout, self._params.zero = self._layout, self._zero
        self._within = (lambda: None) if within is None else weakref.ref(within)
        if model is not None and world_size() > 1:  # every rank, at the same point: collective under pipelining
            self.failures.run("find the pipeline stages (only rank 0's layers are measured)", lambda: self._find_stages(model), 0)
        if self._together:  # every rank, at the same point: making a group is collective
            self.failures.run("make the ranks' group for agreeing (no step is sampled)", self._open_vote, 0)
        if self._pacer is not None and world_size() > 1:
            self._interval_sync = self._sync
            if not self._together and not self.failures.run(
                    f"make the ranks' group for sharing the sampling interval (every {UNSHARED_INTERVAL} steps instead)",
                    self._open_interval_sync, 0):
                self._pacer, self._schedule = None, every_n_steps(UNSHARED_INTERVAL)
        if self._layout.flat_only and is_writer_rank():
            self.failures.warn(
                f"layerwatch: FSDP wraps {', '.join(self._layout.flat_only)} with use_orig_params=False, so their "
                "parameters exist only as flat parameters that each hold many of them, and are not measured; "
                "per-parameter statistics (weights, grads, updates) need FullyShardedDataParallel(..., "
                "use_orig_params=True). The per-module families go on."
            )
        if is_writer_rank():
            writer = self._writer
            if writer is None:
                self.failures.run("open the TensorBoard writer (nothing is written; training goes on)", self._open_writer, 0)
            else:
                self._sink = TensorBoardSink(writer, owns_writer=False)
        if self.options.sentinel:  # every rank: its shards, or (DDP) the same gradients, so the same findings
            self._sentinel = NonfiniteSentinel()
        if self._together:
            self.replay_hint = (f"a {'pipelined' if self._stages is not None else 'sharded'} run's ranks agree on a finding "
                                "a step later, after the optimizer step, so the bad step is not replayed")
        self._state = "running"
        model = self._model()
        if model is not None and (is_writer_rank() or self._together):
            params = [p for _, p in self._layout.parameters(model)]
            self.failures.run("prepare the probes", lambda: self._probes.prepare(model, params, compiled_by_caller), 0)
        names = [name for name, _ in self._layout.parameters(model)]
        if not names:
            self.failures.warn_once("no-params", "layerwatch: the model has no parameters; there is nothing to log")
        if self._sink is not None and model is not None:
            modules = [probe_name(name) for name, _ in select_modules(model, self.options.modules)]
            if self._stages is not None:  # every stage's layers
                names, modules = self._stages.params, self._stages.modules
            layout = R.custom_scalars_layout(names, modules, self.options.families, self.options.stats)
            if layout:
                self._write_with(lambda sink: sink.write_layout(layout), "write the chart layout")
        return self

    @property
    def deepspeed_client(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer a DeepSpeed ZeRO engine steps (the one it was given), whose step hooks
        must call :meth:`before_optimizer_step` and :meth:`after_optimizer_step`: its gradients
        exist there only. None outside ZeRO."""
        return None if self._zero is None else self._zero.client

    def _find_stages(self, model: nn.Module) -> None:
        modules = tuple(probe_name(name) for name, _ in select_modules(model, self.options.modules))
        held = Held(tuple(name for name, _ in self._layout.parameters(model)), modules, self._layout.sharded)
        self._stages = find_stages(held, self.failures)
        if self._stages is None:
            return
        self._layout.staged = True
        self._attached.removables.append(self._stages)
        if self._probes.structure_pending and is_writer_rank():
            self.failures.warn("layerwatch: the model is split into pipeline stages, and each rank runs one stage's "
                               "forward, so the layer table of the whole model is not recorded (layerwatch/structure); "
                               "call layerwatch.summarize(model, batch) on the whole model before it is split")
        self._probes.structure_pending = False

    @property
    def _together(self) -> bool:
        """Every rank takes part in every sampled step, and the ranks vote on which steps those
        are: a sharded run, or pipeline stages."""
        return self._layout.sharded or self._stages is not None

    def _open_vote(self) -> None:
        self._sync = RankSync()
        self._params.sync = self._sync if self._layout.sharded else None  # stages reduce nothing together
        self._vote = StepVote(self._sync)
        self._attached.removables.append(self._vote)  # waits for its ballot, then closes the group

    def _open_interval_sync(self) -> None:
        self._interval_sync = RankSync(REPLAY_GATHER_TIMEOUT_S)
        self._attached.removables.append(self._interval_sync)

    def _open_writer(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=None if self.log_dir is None else str(self.log_dir))
        self._sink = TensorBoardSink(writer, owns_writer=True)

    def finish(self) -> None:
        """Remove every hook, flush and (if owned) close the writer. Safe to call twice."""
        if self._state == "finished":
            return
        if self._health is not None and self._state == "running":
            self._health.say_if_too_short(self._samples_written)
        self._drop_sample()
        self._sentinel = None
        self._micro_batches, self._optimizers, self._within = [], [], lambda: None
        self._vote = self._sync = self._params.sync = self._interval_sync = None  # closed with the hooks, below
        self._param_cache = self._sentinel_watching = None
        self._params.release()
        self._probes.workspace.clear()
        if self._sink is not None:
            self._write_with(lambda sink: sink.close(), "flush the writer")
            self._sink = None
        self._release()
        self._writer = None
        self._state = "finished"

    def track_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Count these optimizers' steps (a post-hook each, until :meth:`finish`), so that a step
        the optimizer skipped (a GradScaler overflow) is not taken for a model fault."""
        self._counter.track(optimizers)
        self._optimizers += [weakref.ref(optimizer) for optimizer in optimizers]

    def add_sink(self, sink: Callable[[R.StepRecord], None]) -> None:
        """Also hand every record written (rank 0) to ``sink``."""
        self._extra_sinks.append(sink)

    def attach(self, handles: Sequence[Any]) -> None:
        """Hooks a front door put on the user's objects (anything with ``remove()``): removed
        at :meth:`finish`, or when the engine is garbage-collected."""
        self._attached.handles += list(handles)

    # ------------------------------------------------------------------ the step protocol

    def begin_step(self, step: int, *, may_sample: bool = True) -> bool:
        """Open ``step``; sampled when the schedule says so (or the sentinel asked for it) and
        ``may_sample``. Arms the module hooks of a sampled step. Returns whether it is sampled."""
        self._check_running("begin_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        started = time.perf_counter()
        if self._last_off_own_s is not None and self._pacer is not None:
            self._pacer.off_step(started - self._opened_at, self._last_off_own_s)
        self._opened_at = started
        self._last_off_own_s = None
        self._drop_sample()
        self._step = step
        self._micro_batches = []
        self._sentinel_checked = False
        if not self._sampled(step, may_sample):
            self._own_s = time.perf_counter() - started
            return False
        model = self._model()
        sample = self._sample = _Sample(step, self._layout.parameters(model), self._counter.count)
        self._param_cache = sample.params
        if model is not None and (is_writer_rank() or self._together):
            self._probes.arm(model, [p for _, p in sample.params], step, writer=is_writer_rank())
            self._collector.attach()
        sample.overhead_s += time.perf_counter() - started
        return True

    def replay_with(self, closure: Callable[[], Any]) -> None:
        """Let the open step be replayed: ``closure()`` computes the loss of this step's batch
        again (a micro-batch's, with gradient accumulation: call it once per micro-batch),
        and is called before that forward, so that the RNG state it starts from is noted.

        When the sentinel finds NaN/Inf gradients at this step, :meth:`before_optimizer_step`
        runs each closure again, with every probe armed and fresh gradients, and calls
        ``backward()`` on what it returns (a loss tensor, or a mapping with a ``"loss"``), to
        name the module that made the NaN. RNG states, buffers, gradients and module modes are
        restored after it (see :mod:`~layerwatch.replay`). The front door must call
        ``before_optimizer_step`` after the backward and only when the optimizer will step (a
        GradScaler's skipped step is not a fault). Nothing is kept past the step. On compiled
        code whose layer table cannot come from the shapes of its inputs, the first sampled
        step's closure gives it (one more forward, run eagerly, after the step; see
        :meth:`_table_eagerly`).

        Raises:
            TypeError: ``closure`` is not callable.
        """
        self._check_running("replay_with")
        if not callable(closure):
            raise TypeError(f"closure must be callable, got {type(closure).__name__}")
        if (self._sentinel is not None or self._probes.table_waits) and not self._together:
            self._replay_offered = True
            self._micro_batches.append(MicroBatch(closure, RngState.capture()))

    def before_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """The gradients of ``optimizer``'s parameters (of every parameter when None) are
        final: read those not read yet this step, and snapshot their weights for the update
        ratios. With several optimizers, call it before each one's step. When the step can be
        replayed (:meth:`replay_with`), the sentinel's check is read here, first."""
        started = time.perf_counter()
        self._check_sentinel(before_optimizer_step=True)  # before each optimizer's step: a later one's gradients may be new
        sample = self._sample
        if sample is None:
            self._own_s += time.perf_counter() - started
            return
        params = (sample.unread(sample.grads_read, optimizer) if self._zero is None  # DeepSpeed's client holds flat partitions
                  else sample.unread(sample.grads_read, None, keep=self._zero.stepping_params(sample.params)))
        if params:
            sample.before_calls += 1
            self._read_grads(sample, params)
            if "updates" in self.options.families:
                key = None if optimizer is None else id(optimizer)
                self.failures.run("snapshot weights for update ratios", lambda: self._snapshot(sample, params, key), sample.step)
        sample.overhead_s += time.perf_counter() - started

    def after_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None, *, stepped: Optional[bool] = None) -> None:
        """``optimizer`` (every optimizer when None) has stepped: measure the updates of its
        parameters and read their weights. ``stepped``, when the caller knows it (call it on
        every step then): whether the optimizer really stepped (False: a GradScaler skip),
        counted as :meth:`track_optimizers` counts, without a hook."""
        if stepped is not None:
            self._counter.add(stepped)
        sample = self._sample
        if sample is None:
            return
        started = time.perf_counter()
        key = None if optimizer is None else id(optimizer)
        mine = [key is None or owner in (key, None) for owner, _ in sample.snapshots]
        snapshots = [snap for (_, snap), taken in zip(sample.snapshots, mine) if taken]
        sample.snapshots = [entry for entry, taken in zip(sample.snapshots, mine) if not taken]
        params = sample.unread(sample.weights_read, optimizer)
        if snapshots or params:
            sample.after_calls += 1
        for snapshot in snapshots:
            self.failures.run("measure updates", lambda: self._measure_update(sample, snapshot), sample.step)
        self._read_weights(sample, params)
        sample.overhead_s += time.perf_counter() - started

    def end_step(self) -> Optional[int]:
        """Close the open step: the sentinel's check; a sampled step is read to the end and
        written. Returns the step written, or None."""
        self._check_running("end_step")
        entered = time.perf_counter()
        self._check_sentinel()
        micro_batches, self._micro_batches = self._micro_batches, []
        sample, self._sample = self._sample, None
        if sample is None:
            ended = time.perf_counter()
            self._off_steps.append(ended - self._opened_at)
            if self._pacer is not None:
                if self._pacer(self._step):
                    self._share_interval()
                self._last_off_own_s = self._own_s + time.perf_counter() - entered
            return None
        started = time.perf_counter()
        sample.overhead_s += self._probes.hook_seconds
        trained = any(p.grad is not None for _, p in sample.params)
        sync = None if self._stages is not None else self._sync  # a stage's probes combine nothing with other ranks'
        structure, probes = self._probes.take(sync, sample.step, trained, self._layout.flattened)
        probes = sample.replay or probes
        if structure is None and self._probes.table_waits and world_size() == 1:
            structure = self._table_eagerly(micro_batches[0] if micro_batches else None)
        self._read_grads(sample, sample.unread(sample.grads_read, None))
        for _, snapshot in sample.snapshots:
            self.failures.run("measure updates", lambda: self._measure_update(sample, snapshot), sample.step)
        self._read_weights(sample, sample.unread(sample.weights_read, None))
        stages: list[Optional[StagePart]] = []  # every stage's measurements, on the writer
        if self._stages is not None:  # every rank, whatever it measured: collective
            self.failures.run("gather the pipeline stages' measurements", lambda: stages.append(self._stages.gather(
                sample.step, lambda: self._host_rows(sample), probes, lambda: self._trainable(sample))), sample.step)
            probes = stages[0].probes if stages and stages[0] is not None else None
        if is_writer_rank() and (self._stages is None or stages):
            self.failures.run("write the sampled step", lambda: self._write(sample, started, structure, probes,
                                                                            stages[0] if stages else None), sample.step)
        self._collector.remove()
        if self._pacer is not None and self._pacer(sample.step):
            self._share_interval()
        return sample.step

    def _sampled(self, step: int, may_sample: bool) -> bool:
        """Whether ``step`` is sampled: the schedule says so, or the sentinel asked for it. In a
        sharded run the ranks decide together (every rank asks its schedule, which checks it;
        rank 0's answer counts), a step ahead."""
        vote = self._vote
        if vote is None and self._together:
            return False  # the ranks cannot agree on a sample, so none is taken
        if vote is None:
            if not (may_sample and (self._force_sample or self._scheduled(step))):
                return False
            self._force_sample = False
            return True
        decision = vote.decide(step, self._ballot)
        if decision.finding_step is not None:
            self._on_voted_finding(decision, step)
        # Every rank alike (may_sample is the same on every rank): a sample asked for and not
        # taken now is asked for again.
        self._force_sample = decision.sampled and not may_sample and (self._force_sample or decision.finding_step is not None)
        vote.send(step + 1, self._ballot(step + 1))
        if self._pacer is not None and not decision.forced:  # the ballot went out before the interval last changed
            return may_sample and decision.sampled and self._pacer(step)
        return may_sample and decision.sampled

    def _ballot(self, step: int) -> Ballot:
        scheduled = self._scheduled(step)
        finding = None if self._finding_reported else self._finding
        return Ballot(scheduled and is_writer_rank(), self._force_sample, None if finding is None else finding.step,
                      finding is not None and finding.nan)

    def _scheduled(self, step: int) -> bool:
        """The schedule's answer for ``step``. Its first call is its check: what it raises then
        is raised, with the schedule named; later it is warned about once and the step is
        not sampled (a training run is never stopped by it)."""
        schedule = self._schedule
        if self._schedule_checked:
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
        self._schedule_checked = True
        return answer

    # ------------------------------------------------------------------ reading

    def _check_running(self, what: str) -> None:
        if self._state != "running":
            raise RuntimeError(f"{what}() called on an {self.owner.lower()} that is {self._state}; call start() first")

    def _drop_sample(self) -> None:
        self._probes.disarm()
        self._collector.remove()
        self._sample = None

    def _read_grads(self, sample: _Sample, params: list[tuple[str, nn.Parameter]]) -> None:
        if params and "grads" in self.options.families:
            self.failures.run("read gradients", lambda: sample.grads.extend(self._params.gradients(params, sample.step)), sample.step)

    def _read_weights(self, sample: _Sample, params: list[tuple[str, nn.Parameter]]) -> None:
        if params and "weights" in self.options.families:
            self.failures.run("read weights", lambda: sample.weights.extend(self._params.weights(params)), sample.step)

    def _snapshot(self, sample: _Sample, params: list[tuple[str, nn.Parameter]], key: Optional[int]) -> None:
        if not sample.snapshots:  # the step's first: what a memory_budget given as a share is a share of
            tensors = local_tensors([p for _, p in sample.params])
            self._params.start_snapshots(sum([t.numel() * t.element_size() for t in tensors]))
        sample.snapshots.append((key, self._params.snapshot(params, sample.step, f"snapshot{len(sample.snapshots)}.")))

    def _measure_update(self, sample: _Sample, snapshot: Snapshot) -> None:
        weight_norms = "weights" not in self.options.families
        pieces = self._params.updates(snapshot, sample.params, weight_norms=weight_norms)
        (sample.update_estimate if snapshot.estimated else sample.update).extend(pieces)

    # ------------------------------------------------------------------ writing

    def _write(self, sample: _Sample, started: float, structure: Optional[Summary], probes: Optional[ProbeResult],
               stages: Optional[StagePart] = None) -> None:
        """Rank 0: the step's rows to the host, what they and the probes say, then its record
        (:func:`~layerwatch.record.build`) to the sinks. The record is built and written after
        the step's cost is taken, so both count in the next sample's (``_overhead_s``).
        ``stages``: every pipeline stage's rows and trainable parameters, gathered already."""
        rows = self._host_rows(sample) if stages is None else stages.rows
        findings = self._findings(sample, rows, probes, None if stages is None else stages.trainable)
        cost_s = self._overhead_s(sample, started)
        interval = None if self._pacer is None else self._choose_interval(sample.step, cost_s)
        writing = time.perf_counter()
        rec = R.build(sample.step, rows, probes, structure, findings, stats=self.options.stats, bins=self.options.bins,
                      overhead_ms=1e3 * cost_s, sample_interval=interval, all_grads=stages is None or stages.complete)
        self._samples_written += 1
        self._emit(rec)
        self._last_write_s = time.perf_counter() - writing
        self._announce(rec.step, findings.alerts)

    def _host_rows(self, sample: _Sample) -> R.HostRows:
        """The families' rows, on the host in one transfer per device, less the rows a rank
        could not help measure."""
        families = {"grads": sample.grads, "weights": sample.weights, "update": sample.update,
                    "update_estimate": sample.update_estimate}
        arrays = iter(S.to_host([rows for pieces in families.values() for _, rows in pieces]))
        return {
            family: [self._measured(family, names, next(arrays).reshape(2 if family.startswith("update") else len(names), -1),
                                    sample.step) for names, _ in pieces]
            for family, pieces in families.items()
        }

    def _findings(self, sample: _Sample, rows: R.HostRows, probes: Optional[ProbeResult],
                  trainable: Optional[list[str]] = None) -> R.Findings:
        """What the probes' first offender and the health rules say of the step. ``trainable``:
        the names of the parameters with ``requires_grad`` (default: the sample's own)."""
        stepped = self._stepped(sample)
        found: list[Alert] = []
        named = None  # the first offender, when the probes saw the NaN appear (this step, or its batch replayed)
        offender = None if probes is None else probes.offender
        user = None if probes is None else probes.weight_user
        if offender is not None and offender.replayed_from is None and stepped is False:
            logger.info("layerwatch: step %d: %s made a non-finite %s value and no optimizer step followed "
                        "(a GradScaler skip): not a fault", sample.step, offender.name, offender.phase)
        elif (offender or user) is not None and not self._offender_found:
            self._offender_found = True  # raised before the rules, whose alert on the same layer says less
            if offender is None:
                message = self._weights_came_first(sample.step, user, probes.nonfinite_weights)
            elif offender.replayed_from is None and self._fault_step is not None and sample.step > self._fault_step:
                message = self._after_fault(sample.step, offender)
            else:
                named = offender
                message = "first offender: " + offender.describe(sample.step)
            found.append(Alert("nonfinite", (offender or user).name, sample.step, message))
        if self._health is None:
            return R.Findings(alerts=found, offender=named)
        trainable = self._trainable(sample) if trainable is None else trainable
        findings = self._health.judge(sample.step, rows, "grads" in self.options.families, trainable, stepped, found)
        findings.offender = named
        return findings

    @staticmethod
    def _trainable(sample: _Sample) -> list[str]:
        """The sample's parameters with ``requires_grad``, as the health rules count them."""
        return [  # a sparse gradient exists but is not measured: not "no gradient"
            name for name, p in sample.params if p.requires_grad and not (p.grad is not None and p.grad.is_sparse)
        ]

    def _measured(self, family: str, names: list[str], rows: np.ndarray, step: int) -> tuple[list[str], np.ndarray]:
        """``names`` and their rows (update pieces: their two rows of columns) less the sharded
        tensors a rank could not help measure, or snapshot (said once)."""
        update = family.startswith("update")  # update and update_estimate: two rows of columns
        failed = rows[0] == FAILED_NORM if update else S.Rows(rows).failed
        if not failed.any():
            return names, rows
        left_out = [name for name, bad in zip(names, failed) if bad]
        which = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        what = ("snapshot its shards of {} for the update ratios; their update ratios are left out" if update
                else f"measure its shards of {{}} ({family}); they are left out")
        self.failures.warn_once(f"failed-rows:{family}", f"layerwatch: a rank could not {what.format(which)} of step {step}")
        kept = [name for name, bad in zip(names, failed) if not bad]
        return kept, rows[:, ~failed] if update else rows[~failed]

    def _overhead_s(self, sample: _Sample, started: float) -> float:
        """What sampling added to this step: the time measured in our own code, plus the step's
        excess over the median recent unsampled step beyond that (what no timer of ours sees:
        torch's slower path for hooked modules, the collector, page faults), taken up to
        ``EXCESS_LIMIT`` times the measured time, plus the garbage collector's time during the
        step (collections our allocations bring on, in the user's code as well as ours): a step
        slowed by more than that was slowed by something else (a validation loop, a
        checkpoint) and is not put down to sampling. The record's build and write are counted
        at the previous sample's duration: they come after this figure."""
        now = time.perf_counter()
        measured = sample.overhead_s + now - started + self._last_write_s
        collected = self._collector.seconds
        if len(self._off_steps) < 3:
            return measured
        excess = now - self._opened_at + self._last_write_s - statistics.median(self._off_steps)
        return min(max(measured, excess), (1 + EXCESS_LIMIT) * measured + collected)

    # ------------------------------------------------------------------ the overhead budget

    def _choose_interval(self, step: int, cost_s: float) -> int:
        """Rank 0, at a sampled step: the interval from here on (proposed to the ranks by
        :meth:`_share_interval`); its measurements count when the budget scheduled the step."""
        pacer = self._pacer
        if pacer(step):  # the step's time counts the write as the cost does: the previous sample's
            pacer.sampled(cost_s, time.perf_counter() - self._opened_at + self._last_write_s)
            self._proposed_interval = pacer.decide()
        return self._proposed_interval or pacer.interval or 1

    def _share_interval(self) -> None:
        """At each step the budget schedules, sampled or not, on every rank alike: take rank
        0's interval (a broadcast in a distributed run) and say so when it changed."""
        proposed, self._proposed_interval = self._proposed_interval, None
        sync = self._interval_sync
        if sync is not None:
            shared: list[int] = []
            if not self.failures.run("share the sampling interval", lambda: shared.append(sync.broadcast(proposed or 0)), self._step):
                return
            proposed = shared[0] or None
        pacer = self._pacer
        if proposed is None or proposed == pacer.interval:
            return
        previous, pacer.interval = pacer.interval, proposed
        if is_writer_rank():
            self.failures.say(pacer.message(previous))

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs to sample as this one would: the overhead budget's interval
        (empty under a fixed schedule, or before the interval is chosen)."""
        if self._pacer is None or self._pacer.interval is None:
            return {}
        return {"sample_interval": self._pacer.interval}

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
        if self._pacer is not None:
            self._pacer.interval = interval

    def _stepped(self, sample: _Sample) -> Optional[bool]:
        """Whether the optimizer stepped during the sample: counted when the optimizers are
        tracked; else False when ``before_optimizer_step`` came and ``after_optimizer_step``
        did not (an optimizer's post-hook never fires for a skipped step); else unknown."""
        now = self._counter.count
        if sample.steps_before is not None and now is not None:
            return now != sample.steps_before
        return None if sample.before_calls == 0 else sample.after_calls >= sample.before_calls

    def _emit(self, rec: R.StepRecord) -> None:
        self._write_with(lambda sink: sink.write(rec), "write the sampled step")
        for extra in self._extra_sinks:
            self.failures.run("hand the step to an added sink", lambda: extra(rec), rec.step)

    def _write_with(self, action: Callable[[TensorBoardSink], None], what: str) -> None:
        """A write; a failed one stops all further writing (a full disk does not heal mid-run)."""
        sink = self._sink
        if sink is not None and not self.failures.run(what, lambda: action(sink), self._step):
            self._sink = None

    # ------------------------------------------------------------------ NaN sentinel

    def _check_sentinel(self, before_optimizer_step: bool = False) -> None:
        """Enqueue a check of the gradients; act on the checks that have landed.

        ``before_optimizer_step``: the gradients are those the optimizer steps with (every door
        gets here; some loops clear them before the step ends, as the Hugging Face Trainer
        does), so this step's check is enqueued here. When the step can be replayed it is read
        at once (on a GPU, a sync) and a finding replays it: the optimizer steps after this (a
        door offers no replay where a GradScaler may skip the step). At the end of the step, a
        step not checked before is checked now, and the checks that have landed are read."""
        sentinel = self._sentinel
        if sentinel is None:
            return
        step = self._step
        replayable = before_optimizer_step and bool(self._micro_batches)
        if before_optimizer_step:
            stepped: Optional[bool] = True if replayable else None  # else settled at the end of the step
        else:
            stepped = self._counter.stepped_since_last_check()
            sentinel.settle(step, stepped)
        if before_optimizer_step or not self._sentinel_checked:
            self._sentinel_checked = True
            if self._param_cache is None:
                self._param_cache = self._layout.parameters(self._model())
            self.failures.run("check the gradients for NaN/Inf", lambda: self._enqueue_check(sentinel, step, stepped), step)
        if before_optimizer_step and not replayable:
            return
        findings = sentinel.poll(wait=replayable)
        skipped = None if before_optimizer_step or self._zero is None else self._zero.skipped_finding(step)
        findings += [skipped] if skipped is not None else []
        for finding in findings:
            if finding.stepped is False:
                logger.info("layerwatch: step %d: NaN/Inf gradients and no optimizer step (a GradScaler skip)", finding.step)
                continue
            if self._vote is not None:  # the ranks act on it together, once they have voted
                self._finding = self._finding or finding
                break
            self._sentinel = None  # before the replay: nothing in it checks again
            if replayable and finding.step == step and self._replay(finding):
                break
            self._fault_step = finding.step
            self._force_sample = True
            if self._reported is not finding:  # a replay that named nothing has said it already
                self.failures.run("report NaN/Inf gradients", lambda: self._on_nonfinite(finding, step + 1), step)
            break

    def _enqueue_check(self, sentinel: NonfiniteSentinel, step: int, stepped: Optional[bool]) -> None:
        if self._zero is not None:  # the group DeepSpeed steps now: its averaged gradient partition, this rank's
            sentinel.check(step, self._zero.flat_gradients(), stepped)
            return
        if self._sentinel_watching is not self._param_cache:  # walked again at a sample: new shares
            self._sentinel_watching = self._param_cache
            sentinel.watch(self._param_cache, local)
        sentinel.check_next(step, stepped)

    def _on_voted_finding(self, decision: Decision, step: int) -> None:
        """A rank's sentinel found NaN/Inf gradients, and every rank knows it now: none checks
        again, ``step`` is sampled, and rank 0 reports it (with the tensors, when its own
        shards held them)."""
        if self._finding_reported:
            return
        self._finding_reported = True
        self._fault_step = decision.finding_step
        own, self._finding = self._finding, None
        if is_writer_rank():
            mine = own is not None and own.step == decision.finding_step
            rotation = 1 if self._sentinel is None else self._sentinel.rotation
            finding = Finding(decision.finding_step, own.tensors if mine else [], None, decision.finding_nan, rotation,
                              own.seen_by if mine else "")
            self.failures.run("report NaN/Inf gradients", lambda: self._on_nonfinite(finding, step), step)
        self._sentinel = None

    def _replay(self, finding: Finding) -> bool:
        """Run the open step's micro-batches again with every probe armed, before its optimizer
        step (see replay.py). Returns whether a module was named: the step is then sampled,
        with what the replay's probes saw.

        In a DDP run every rank gets here at the same step (they check the same synchronized
        gradients). The replay may issue collectives of its own (the closure's DDP forward,
        SyncBatchNorm), so the ranks first agree that every one of them can replay; then each
        replays its own batch, and they share what they found."""
        model = self._model()
        step = self._step
        unseeable = model is not None and is_compiled(model) and not hasattr(torch.compiler, "set_stance")
        if unseeable:
            self.replay_hint = ("the model is compiled, and this torch (before 2.6) cannot run it eagerly for the "
                                "probes to see inside, so it is not replayed")
        can = (model is not None and not unseeable and "nonfinite" in self.options.families
               and self._probes.runtime_on
               and not self._probes.sees_nonfinite)  # sees it: sampled, saw it happen
        if can:  # weights NaN/Inf already: the fault came earlier, and a replay would name their first user
            bad: list[str] = []
            self.failures.run("look for NaN/Inf weights", lambda: bad.extend(self._nonfinite(self._layout.parameters(model))), step)
            self._fault_before, can = bool(bad), not bad
        found: list[Optional[tuple[int, ProbeResult]]] = [None]  # the micro-batch that named it, and its probes
        ranks: list[Any] = []
        ran = [False]  # the replay ran to its end here (else its failure was warned about)
        started = time.perf_counter()

        def run_again() -> None:
            found[0] = self._run_again(model)

        def replay_here() -> None:
            self.failures.run("report NaN/Inf gradients", lambda: self._on_nonfinite(finding, None), step)
            ran[0] = self.failures.run(f"replay step {step}'s batch", run_again, step)

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
            return False
        index, name, phase = ranks[rank]
        parts = ([f"micro-batch {index + 1} of {len(self._micro_batches)}"] if len(self._micro_batches) > 1 else []) + (
            [f"rank {rank}'s batch"] if rank != 0 else [])
        offender = Offender(name, phase, replayed_from=step, replayed_what=", ".join(parts))
        result = ProbeResult([], None) if found[0] is None else found[0][1]
        result.offender = offender
        sample = self._sample
        if sample is None:
            model_params = self._param_cache if self._param_cache is not None else self._layout.parameters(model)
            sample = self._sample = _Sample(step, model_params, self._counter.count)
            self._param_cache = sample.params
        sample.replay = result
        sample.overhead_s += time.perf_counter() - started
        return True

    def _run_again(self, model: nn.Module) -> Optional[tuple[int, ProbeResult]]:
        """The micro-batches replayed until one's probes name an offender (replay.py): its
        index and their result; None when none did."""
        within = self._within()
        beyond = [p for ref in self._optimizers if ref() is not None for group in ref().param_groups for p in group["params"]]
        return replay_until_named(
            model, self._micro_batches, self._probes, self._step, writer=is_writer_rank(),
            params=[p for _, p in self._layout.parameters(model)], within=within,
            also=beyond + ([] if within is None else list(within.parameters())), copy_gradients=world_size() > 1,
        )

    def _table_eagerly(self, micro: Optional[MicroBatch]) -> Optional[Summary]:
        """The layer table of a compiled model: from one forward of the shapes of the step's
        inputs under fake tensors (probes/shapes.py), or where there are none or that fails,
        from one forward of the step's first micro-batch run again eagerly (replay.py). Not in
        a distributed run: that forward may issue collectives (DDP's buffer broadcast), and
        only rank 0 records the table."""
        model = self._model()
        tables: list[Optional[Summary]] = []
        if model is not None:
            self.failures.run("record the layer table from shapes", lambda: tables.append(
                self._probes.table_from_shapes(model, self._step)), self._step)
        if model is not None and all(table is None for table in tables) and micro is not None and self._probes.table_waits:
            self.failures.run("record the layer table eagerly", lambda: tables.append(
                self._probes.table_eagerly(model, self._step, lambda: forward_again(model, micro))), self._step)
        return next((table for table in tables if table is not None), None)

    def _on_nonfinite(self, finding: Finding, sampled_step: Optional[int]) -> None:
        """The sentinel's first hit: the step, and a warning saying what comes next: the
        replay of that step (``sampled_step`` None), or every probe armed at ``sampled_step``."""
        self._reported = finding
        if not is_writer_rank():
            return
        rec = R.build(finding.step, first_nonfinite_step=finding.step)
        names = ", ".join(finding.tensors[:5]) + (f" and {len(finding.tensors) - 5} more" if len(finding.tensors) > 5 else "")
        where = f" in {names}" if names else " in gradients (shards, or a pipeline stage's) held by another rank"
        overflow = "" if finding.nan else " (or finite gradients whose norm passes ~1.8e19: an explosion)"
        every = "every step" if finding.rotation == 1 else f"each gradient at least every {finding.rotation} steps"
        if sampled_step is None:
            then = "its batch is run again with every probe armed, before the optimizer step, to find the module that made it"
        elif finding.step == self._step and self._probes.sees_nonfinite:
            then = "this step is sampled with every probe armed, so they name the module that made it"
        else:
            which = "the next step" if sampled_step == self._step + 1 else f"step {sampled_step}"
            before = ("the weights held NaN/Inf already, so the fault came earlier, in gradients the sentinel had not "
                      "checked yet; " if self._fault_before else "")
            then = (f"{before}{which} is sampled with every probe armed; it shows what came after the fault, not the "
                    f"module that made it ({self._unreplayed()})")
        seen = f"(the sentinel, {every}){where}{overflow}" if not finding.seen_by else f"({finding.seen_by})"
        message = f"NaN/Inf gradients at step {finding.step} {seen}; {then}"
        self._emit(rec)
        logger.warning("layerwatch: %s", message)
        self.failures.warn(f"layerwatch: {message}")

    def _unreplayed(self) -> str:
        """Why the fault's step was not replayed: the front door's words, or what the engine knows."""
        if self.replay_hint is not None:
            return self.replay_hint
        if self._replay_offered:
            return "the sentinel saw it after the step it happened in had passed, so that step was not replayed"
        return "to find it, let layerwatch replay the bad step: Inspector.replay_with(closure) before each step's forward"

    @staticmethod
    def _nonfinite(params: Sequence[tuple[str, nn.Parameter]]) -> list[str]:
        """The parameters whose values (this rank's) hold NaN/Inf."""
        return nonfinite_names([(name, local(p)) for name, p in params])

    def _after_fault(self, step: int, offender: Offender) -> str:
        """What an offender seen after an unreplayed fault is: never "the first offender"."""
        when = "before step" if self._fault_before else "at step"
        return (f"first module with a non-finite {offender.phase} output at step {step}: {offender.name}. The fault "
                f"happened {when} {self._fault_step}, between samples; step {step} shows what came after it, which "
                f"need not be where it began ({self._unreplayed()})")

    def _weights_came_first(self, step: int, user: Offender, weights: Sequence[str]) -> str:
        """What a module that computed with a weight that was non-finite already is: it used the
        fault, the optimizer having carried it into the weights; it did not make it."""
        names = ", ".join(weights[:3]) + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")
        if self._fault_step is not None:
            when = f"{'before step' if self._fault_before else 'at step'} {self._fault_step}, between samples"
            how = self._unreplayed()
        else:
            when = f"before step {step}, where no probe saw it"
            how = ("the sentinel is off; with sentinel=True it is found at its step" if not self.options.sentinel
                   else "the sentinel had not checked those gradients yet")
        return (f"first module to use a non-finite weight at step {step}: {user.name} ({names} held NaN/Inf before "
                f"the step's forward). The fault happened {when}; the optimizer carried it into the weights, so the "
                f"module that made it is not known ({how})")

    def _announce(self, step: int, alerts: list[Alert]) -> None:
        """New alerts to Python logging, one record each, and to warnings, one per step."""
        for alert in alerts:
            logger.warning("layerwatch alert at step %d: %s %s: %s", alert.step, alert.kind, alert.name, alert.message)
        if alerts:
            lines = "\n".join(f"  {a.kind} {a.name}: {a.message}" for a in alerts)
            self.failures.warn(f"layerwatch: {len(alerts)} new alert(s) at step {step}:\n{lines}")
