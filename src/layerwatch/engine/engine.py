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

``before_optimizer_step`` and ``after_optimizer_step`` may be left out: ``end_step`` reads whatever the step has not
read yet. Off-steps cost a schedule lookup (and the sentinel's fused check, when it is on). The data flow of a sampled
step is one way: device rows (:mod:`~layerwatch.measure.params`, :mod:`~layerwatch.probes`) -> one transfer per device -> a
:class:`~layerwatch.sinks.record.StepRecord` -> the sinks.

The engine coordinates; each decision has its own home: which steps are sampled (:mod:`~layerwatch.engine.sampling`), what
a sampled step reads (:mod:`~layerwatch.measure.reads`), a compiled model's re-run (:mod:`~layerwatch.engine.rerun`), what NaN/Inf
gradients set going (:mod:`~layerwatch.faults.faults`), where the records go (:mod:`~layerwatch.engine.output`), where the
parameters live (:mod:`~layerwatch.engine.placement`).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from layerwatch.sinks import record as R
from layerwatch.health.alert import Alert
from layerwatch.health.check import HealthCheck
from layerwatch.engine.closing import Closing
from layerwatch.engine.budget import Pacer
from layerwatch.distributed.sharding import Layout, is_writer_rank
from layerwatch.guards.failures import FailurePolicy
from layerwatch.faults.faults import Faults
from layerwatch.guards.hooks import Attachments, CollectorClock, claim
from layerwatch.options import Options, writable_dir
from layerwatch.engine.output import Output
from layerwatch.measure.params import ParameterFamilies
from layerwatch.probes import StepProbes
from layerwatch.engine.rerun import Rerun, Rows
from layerwatch.measure.reads import Sample, SampleReads
from layerwatch.engine.sampling import Sampling
from layerwatch.schedule import Schedule
from layerwatch.health.spikes import Spikes
from layerwatch.faults.sentinel import StepCounter
from layerwatch.engine.placement import Placement, find_placement
from layerwatch.measure.zero import engine_of

logger = logging.getLogger("layerwatch")
logger.addHandler(logging.NullHandler())  # a library logs; the application decides where it goes


class Engine:
    """Samples a model's parameters and modules on a schedule and writes them to TensorBoard.

    Args:
        model: The module to watch. Held by weak reference.
        options: The validated options (:func:`~layerwatch.options.validate_options`).
        writer: A ``SummaryWriter`` to write into (flushed, never closed). Exclusive with ``log_dir``.
        log_dir: Directory for a ``SummaryWriter`` the engine owns and closes. With neither, ``SummaryWriter()``'s
            default ``runs/...`` directory.
        owner: The front door's name, as its messages spell it (``"Inspector"``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``writer`` lacks the ``SummaryWriter`` interface.
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
        self.options, self.owner = options, owner
        self.log_dir = None if log_dir is None else writable_dir(log_dir)
        self._model = weakref.ref(model)
        self._state, self._step, self._armed, self._own_s = "new", 0, False, 0.0
        self._sample: Optional[Sample] = None  # _armed: its hooks are on, from a sampled step's start to the next step's
        self.failures = FailurePolicy()
        self._params = ParameterFamilies(options, self.failures)
        self._reads = SampleReads(options, self.failures, self._params)
        self._probes = StepProbes(options.families, options.modules, options.stats, options.bins, self.failures,
                                  output_head=options.output_head, moe_routers=options.moe_routers)
        self._rerun = Rerun(self._probes, self.failures)  # a compiled model's sampled step, run again eagerly
        self._health = None if options.rules is None else HealthCheck(options.rules, self.failures)
        self._counter = StepCounter()
        # What is attached to the user's objects lives apart from the engine and goes with it.
        self._attached = Attachments()
        self._collector = CollectorClock()
        self._attached.hold(self._probes, self._rerun, self._counter, self._collector)
        self._release = weakref.finalize(self, self._attached.release)
        self._output = Output(self._attached, self.failures, writer)
        self._sampling = Sampling(options, self.failures)
        self._faults = Faults(options, self.failures, self._probes, self._counter, self._output.write_fault, self._sampling.ask)
        self._spikes = Spikes(options.spikes, self.failures, self._sampling.ask, self._output.write_findings,
                              self._health and self._health.progress)
        self._closing = Closing(options, self.failures, self._probes, self._rerun, self._reads, self._faults, self._spikes,
                                self._health, self._sampling, self._output, self._collector, self._counter)
        self._placement = Placement(Layout())  # where the parameters live: found at start()
        # The parameters as last walked (a walk costs per module: once, then at each sample).
        self._param_cache: Optional[list[tuple[str, nn.Parameter]]] = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def state(self) -> str:
        """``"new"``, then ``"running"`` from :meth:`start`, then ``"finished"`` from :meth:`finish`."""
        return self._state

    @property
    def schedule(self) -> Schedule | Pacer:
        """What chooses the sampled steps: the schedule given, or the overhead budget's pacer (its ``interval``)."""
        return self._sampling.schedule

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

    def describe_replay(self, *, unreplayable: Optional[str] = None, differs: Optional[str] = None) -> None:
        """The front door's words of its replay: why a fault's step cannot be replayed, or what a replay runs differently."""
        self._faults.describe_replay(unreplayable, differs)

    def start(self, *, within: Optional[nn.Module] = None, compiled_by_caller: bool = False,
              deepspeed: Any = None, optimizer: Optional[torch.optim.Optimizer] = None) -> "Engine":
        """Open the writer (rank 0) and write the chart layout. Opens no step. A model still watched by an earlier
        engine that was never finished is taken from it: that engine is finished first (hooks removed, writer flushed).
        In a distributed run, call it on every rank at the same point: a sharded run makes the ranks' group here.

        ``within``: a module the model is wrapped in, whose FSDP units may hold some of its parameters (Lightning's
        ``strategy="fsdp"`` wraps the LightningModule itself).

        ``compiled_by_caller``: the caller compiles the model (the Hugging Face Trainer's ``torch_compile=True``, a
        LightningModule Lightning compiles): it is measured on re-runs of what the caller offers (:meth:`rerun_with`).

        ``deepspeed``: the DeepSpeed engine (or its ZeRO optimizer) that trains the model, when the model is not that
        engine itself. A ``DeepSpeedEngine`` given as the model is watched through the module it trains; with ZeRO,
        every rank reads its partitions (:mod:`~layerwatch.measure.zero`), the gradients in the step pre-hook of the optimizer
        DeepSpeed steps (:attr:`deepspeed_client`, which the front door hooks). ``optimizer``: the one the front door
        hooks; the one given to ``deepspeed.initialize`` leads to ZeRO-1/2's partitions too (another is said once).
        """
        if self._state != "new":
            raise RuntimeError(f"start() called on an {self.owner.lower()} that is {self._state}")
        model = self._model()
        engine = None if model is None else engine_of(model)
        if engine is not None:  # watch the model it trains, under its own names
            model, deepspeed = engine.module, deepspeed or engine
            self._model = weakref.ref(model)
        if model is not None:
            claim(model, self, self.failures)
        self._placement = find_placement(model, within, deepspeed, self.options, self._probes, self.failures, optimizer)
        layout, zero, stages = self._placement.layout, self._placement.zero, self._placement.stages
        self._attached.hold(*[] if stages is None else [stages])
        together = self._placement.together
        self._sampling.open_groups(together, self._attached, self._spikes)  # every rank, at the same point: collective
        self._params.start(layout, zero, self._sampling.sync if layout.sharded else None, model)  # stages reduce nothing together
        if is_writer_rank():
            self._output.open(self.log_dir)
        self._faults.start(self._model, layout, zero, within, together, stages is not None)
        self._spikes.start(together, is_writer_rank())
        self._state = "running"
        if not layout.parameters(model):
            self.failures.warn_once("no-params", "layerwatch: the model has no parameters; there is nothing to log")
        if model is not None:
            self._probes.start(model, compiled_by_caller)
            self._rerun.start(model, within, together, self._placement.collective)
            self._output.write_layout(model, self._placement, self.options, self._step)
        return self

    @property
    def deepspeed_client(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer a DeepSpeed ZeRO engine steps (the one it was given), whose step hooks must call
        :meth:`before_optimizer_step` and :meth:`after_optimizer_step` (its gradients exist there only); else None."""
        zero = self._placement.zero
        return None if zero is None else zero.client

    def finish(self) -> None:
        """Remove every hook, flush and (if owned) close the writer. Safe to call twice."""
        if self._state == "finished":
            return
        if self._state == "running":
            self._spikes.close(self._step, self._health)  # the spikes found since the last sample
            if self._health is not None:
                self._health.say_if_too_short(self._closing.written)
        self._drop_sample()
        self._faults.close()
        self._sampling.close()  # its groups are closed with the hooks, below
        self._param_cache = None
        self._params.release()
        self._probes.workspace.clear()
        self._output.close(self._step)
        self._release()
        self._state = "finished"

    def track_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Count these optimizers' steps (a post-hook each, until :meth:`finish`): a skipped step (a GradScaler's) is no fault."""
        self._counter.track(optimizers)
        self._faults.track(optimizers)

    def add_sink(self, sink: Callable[[R.StepRecord], None]) -> None:
        """Also hand every record written (rank 0) to ``sink``."""
        self._output.add(sink)

    def attach(self, handles: Sequence[Any]) -> None:
        """Hooks a front door put on the user's objects (with ``remove()``): removed at :meth:`finish`, or when collected."""
        self._attached.hold_handles(handles)

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs to sample as this one would (:meth:`~layerwatch.engine.sampling.Sampling.state_dict`)."""
        return self._sampling.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on with a saved :meth:`state_dict` (:meth:`~layerwatch.engine.sampling.Sampling.load_state_dict`)."""
        self._sampling.load_state_dict(state)

    # ------------------------------------------------------------------ the step protocol

    def begin_step(self, step: int, *, may_sample: bool = True) -> bool:
        """Open ``step``; sampled when the schedule (or a fault) says so and ``may_sample``: then its module hooks are
        armed, or a compiled model's re-run awaits its first micro-batch. Returns whether it is sampled."""
        self._check_running("begin_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        started = self._sampling.open()
        self._drop_sample()
        self._step = step
        self._faults.open(step, self._sampling.sentinel_spread, self._sampling.checks_measured)
        if not self._sampling.decide(step, may_sample, self._faults):
            self._own_s = time.perf_counter() - started  # layerwatch's time in the open step, unsampled
            return False
        model = self._model()
        sample = self._sample = Sample(step, self._placement.layout.parameters(model), self._counter.count)
        self._param_cache = sample.params
        if model is not None and (is_writer_rank() or self._placement.together):
            self._armed = True  # before: what a failed arming put on is taken off too
            params = [p for _, p in sample.params]
            self._probes.arm(model, params, step, writer=is_writer_rank())
            self._rerun.arm(step, params, writer=is_writer_rank())
            self._collector.attach()
        sample.spent(time.perf_counter() - started)
        return True

    def replay_with(self, closure: Callable[[], Any], rows: Optional[Rows] = None,
                    forward: Optional[Callable[[], Any]] = None) -> None:
        """Let the open step be replayed (:meth:`Faults.offer <layerwatch.faults.faults.Faults.offer>`): ``closure()``
        computes the loss of this step's batch again (once per micro-batch), called before that forward. The door
        must call :meth:`before_optimizer_step` after the backward, only when the optimizer will step (a GradScaler's
        skipped step is no fault). It (or ``forward``, the forward alone) serves :meth:`rerun_with` too. Raises
        ``TypeError`` when ``closure`` is not callable."""
        self._check_running("replay_with")
        if not callable(closure):
            raise TypeError(f"closure must be callable, got {type(closure).__name__}")
        self._faults.offer(closure, self._placement.together, keep=self._spikes.rule is not None)
        self._rerun.offer(closure if forward is None else forward, rows)

    def rerun_with(self, closure: Callable[[], Any], rows: Optional[Rows] = None) -> None:
        """A forward of the open step's micro-batch (its result unused), before that forward: a compiled model's
        sampled step is measured on the first, run again eagerly (:class:`~layerwatch.engine.rerun.Rerun`); ``rows(n)``: the
        same on its first ``n`` rows. For a door that cannot replay the step (:meth:`replay_with` offers it too)."""
        self._check_running("rerun_with")
        self._rerun.offer(closure, rows)

    def observe(self, value: Any, what: str = "loss") -> None:
        """The open step's loss (micro-batches: averaged) or (``what="grad_norm"``) gradient norm, judged once landed."""
        self._spikes.offer(self._step, value, what)

    def before_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """The gradients of ``optimizer``'s parameters (every parameter's when None) are final: read those not read yet
        this step, and snapshot their weights for the update ratios. With several optimizers, call it before each
        one's step. When the step can be replayed (:meth:`replay_with`), the sentinel's check is read here, first."""
        started = time.perf_counter()
        self._check_faults(before_optimizer_step=True)  # before each optimizer's step: a later one's gradients may be new
        sample = self._sample
        if sample is None:
            self._own_s += time.perf_counter() - started
            return
        if self._armed:  # a model found running compiled has its first micro-batch run again, with the step's weights
            self._rerun.before_optimizer_step(sample.step, sample.trained)
        self._reads.before_optimizer_step(sample, optimizer, self._placement.zero)
        sample.spent(time.perf_counter() - started)

    def after_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None, *, stepped: Optional[bool] = None) -> None:
        """``optimizer`` (every optimizer when None) has stepped: measure the updates of its parameters and read their
        weights. ``stepped``, when the caller knows it (call it on every step then): whether the optimizer really
        stepped (False: a GradScaler skip), counted as :meth:`track_optimizers` counts, without a hook."""
        if stepped is not None:
            self._counter.add(stepped)
        sample = self._sample
        if sample is None:
            return
        started = time.perf_counter()
        self._reads.after_optimizer_step(sample, optimizer)
        sample.spent(time.perf_counter() - started)

    def end_step(self) -> Optional[int]:
        """Close the open step: the sentinel's check, the loss's; a sampled step is read and written. Returns it, or None."""
        self._check_running("end_step")
        entered = time.perf_counter()
        self._check_faults()
        sample, self._sample = self._sample, None
        if sample is None:
            self._sampling.close_unsampled(self._step, entered, self._faults.check_s, self._own_s)
            return None
        self._closing.close(sample, self._placement)
        return sample.step

    def _check_running(self, what: str) -> None:
        if self._state != "running":
            raise RuntimeError(f"{what}() called on an {self.owner.lower()} that is {self._state}; call start() first")

    def _drop_sample(self) -> None:
        if self._armed:
            self._probes.disarm()
            self._rerun.disarm()
            self._collector.remove()
        self._sample, self._armed = None, False

    def _parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters as last walked (walked now, the first time)."""
        if self._param_cache is None:
            self._param_cache = self._placement.layout.parameters(self._model())
        return self._param_cache

    def _check_faults(self, before_optimizer_step: bool = False) -> None:
        """The sentinel's check (:meth:`Faults.check`) and the loss's (:meth:`Spikes.judge`): a replay that named the
        module makes the step sampled with it, and so does a spike at the step, with its batch replayed where it can be."""
        replayed = self._faults.check(self._parameters, before_optimizer_step)
        spiked = self._spikes.judge(self._step, closing=not before_optimizer_step)
        if replayed is None and spiked is not None and self._sample is None:  # replayed only as it ran: before its update
            replayed = (self._faults.replay_spike(spiked) if before_optimizer_step else None) or False
        if replayed is None:
            return
        sample = self._sample = self._sample or Sample(self._step, self._parameters(), self._counter.count)
        self._param_cache = sample.params
        if replayed:
            sample.replayed(*replayed)
