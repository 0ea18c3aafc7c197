"""The module hooks of one sampled step: the layer table's, the first time, and the runtime and
transformer probes', on an eager forward: the step's own, or a compiled model's re-run."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.distributed.agreement import RankSync
from layerwatch.distributed.sharding import is_writer_rank
from layerwatch.guards.failures import FailurePolicy
from layerwatch.guards.hooks import FailedForwardGuard
from layerwatch.probes.result import ProbeResult, Signals
from layerwatch.probes.routers import RouterSpec
from layerwatch.probes.runtime import RuntimeProbe
from layerwatch.probes.selection import ModuleFilter, is_compiled, select_modules
from layerwatch.table.recording import StructureProbe
from layerwatch.probes.terms import ProbeTerms
from layerwatch.probes.transformer import TransformerProbes
from layerwatch.probes.weights import WeightCheck
from layerwatch.table.summary import Summary
from layerwatch.vocabulary import PROBE_FAMILIES, Family

IN_A_COMPILED_CALLER = (
    "layerwatch: the model runs inside compiled code (a torch.compile'd function calls it), so its hooks "
    "recorded nothing on sampled step {step}. Nothing of layerwatch runs inside compiled code: from now on its "
    "sampled steps are measured on an eager re-run of one of their micro-batches, as a compiled model's are. This "
    "sample's hooks stay on the model, inert, until the run ends: the function was compiled with them, and "
    "without them it would compile again."
)


@dataclass(frozen=True)
class ProbesMode:
    """What a run's probes do on its sampled steps: the one state of :class:`StepProbes`,
    replaced (never changed in place) by the transitions below, each of which returns the
    new mode.

    - ``table_pending``: the layer table is still to be recorded (on a whole forward, on the
      rank that writes). Off once recorded, once its probe failed (:meth:`table_done`), or
      for a model split into pipeline stages (:meth:`StepProbes.forgo_layer_table`).
    - ``runtime_on``: the per-module families are on. Off (:meth:`runtime_off`) when no
      module is selected, when a runtime probe failed, or when the ranks did not agree.
    - ``compiled``: the model runs compiled, and its sampled steps are measured on an eager
      re-run. Set when the run starts (:meth:`started`), or once a sample finds the model
      running inside compiled code (:meth:`runs_compiled`).
    """

    table_pending: bool
    runtime_on: bool
    compiled: bool = False

    def started(self, compiled: bool) -> "ProbesMode":
        return replace(self, compiled=compiled)

    def table_done(self) -> "ProbesMode":
        return replace(self, table_pending=False)

    def runtime_off(self) -> "ProbesMode":
        return replace(self, runtime_on=False)

    def runs_compiled(self) -> "ProbesMode":
        return replace(self, compiled=True)


class StepProbes:
    """The module hooks of a sampled step: the layer table (the first time), the runtime and
    transformer probes.

    What they do from step to step is one state, :attr:`mode` (:class:`ProbesMode`, and its
    transitions). Within a sampled step the probes are idle (none armed), armed by
    :meth:`arm` (the hooks on the model), unhooked by :meth:`unhook` (a re-run is over: what
    they measured is kept) and taken by :meth:`take` (idle again), or dropped by
    :meth:`disarm`.

    Nothing of them runs inside compiled code. A model that runs compiled (:attr:`compiled`)
    gets no hook on its own forward; its sampled step is measured on an eager re-run of one
    micro-batch (:mod:`~layerwatch.engine.rerun`), which arms them with ``eager`` and ``forward_only``.
    A model is known to run compiled when it holds compiled parts (``torch.compile(model)``,
    ``model.compile()``, each block compiled), when the caller says it compiles it
    (:meth:`start`), or once a sample shows that it ran inside compiled code (a compiled function
    calls it): none of its hooks ran, yet the step trained (:meth:`take`). Dynamo traced those
    hooks (each returns before anything there) and guards on them: they stay on the model,
    inert, until :meth:`remove`, so that the function is not compiled again.
    """

    def __init__(self, families: Sequence[str], modules: Optional[ModuleFilter], stats: Sequence[str], bins: int,
                 failures: FailurePolicy, output_head: Optional[str] = None,
                 moe_routers: Optional[Sequence[RouterSpec]] = None) -> None:
        self.families, self.modules, self.bins, self.failures = families, modules, bins, failures
        self.zeros, self.centered = "zero_frac" in stats, "std" in stats
        self.mode = ProbesMode(table_pending=Family.STRUCTURE in families,
                               runtime_on=any(family in families for family in PROBE_FAMILIES))
        # The probes of the step armed (all None: idle)
        self._structure: Optional[StructureProbe] = None
        self._runtime: Optional[RuntimeProbe] = None
        self._weights: Optional[WeightCheck] = None  # the weights' NaN/Inf check of this step
        self._forward_guard: Optional[FailedForwardGuard] = None
        self._transformer = TransformerProbes(families, output_head, failures, moe_routers)  # attention, log Z, kurtosis, routers
        self._inert: list[Any] = []  # hooks kept, inert, on a model found running inside compiled code
        self.workspace = S.Workspace()  # kept from one sampled step to the next
        self._cuda_events: list[Any] = []  # the runtime probes' clock marks on a GPU, idem

    @property
    def structure_pending(self) -> bool:
        """Whether the layer table is still to be recorded."""
        return self.mode.table_pending

    @property
    def runtime_on(self) -> bool:
        """Whether the per-module families are on."""
        return self.mode.runtime_on

    @property
    def compiled(self) -> bool:
        """Whether the model runs compiled: measured on a re-run (see the class)."""
        return self.mode.compiled

    def forgo_layer_table(self) -> None:
        """Record no layer table: the model is split into pipeline stages, and no rank runs the
        whole model's forward."""
        self.mode = self.mode.table_done()

    def start(self, model: nn.Module, compiled_by_caller: bool = False) -> None:
        """When the run starts: whether the model runs compiled (it holds compiled parts, or
        ``compiled_by_caller``: the caller compiles it, as Lightning and the Hugging Face
        Trainer say)."""
        self.mode = self.mode.started(compiled_by_caller or is_compiled(model))

    def arm(self, model: nn.Module, parameters: Sequence[nn.Parameter], step: int, writer: bool = True,
            structure: bool = True, eager: bool = False, forward_only: bool = False,
            dense_limit: Optional[int] = None) -> None:
        """Arm this step's hooks: the layer table's (the first time, on the rank that writes,
        unless ``structure`` is False) and the runtime probes'. On a model that runs compiled,
        none: its forward is the compiled code's alone. ``eager``: compiled code runs eagerly
        for this forward (a replay, a re-run), so the hooks see every module. ``forward_only``: a
        compiled model's re-run, one forward with autograd off, whose FlexAttention calls may build
        ``dense_limit`` bytes of scores at most (:class:`~layerwatch.probes.attention.AttentionProbe`)."""
        if self._runtime is not None or self._structure is not None:  # a re-run's, kept for take(): a replay's now
            self.disarm()
        mode = self.mode
        if mode.compiled and not eager:
            return
        writer = writer and structure
        runtime = mode.runtime_on
        if not ((mode.table_pending and writer) or runtime):
            return
        if runtime and Family.NONFINITE in self.families:  # before the forward: what its modules compute with
            self.failures.run("check the weights for NaN/Inf", lambda: self._check_weights(model, parameters), step)
        if mode.table_pending and writer:
            self.failures.run("record the layer table", lambda: self._arm_structure(model, forward_only), step)
        if runtime:
            self.failures.run("arm the runtime probes",
                              lambda: self._arm_runtime(model, parameters, forward_only, dense_limit), step)
        if self._structure is not None or self._runtime is not None:
            self.failures.run("guard the forward", lambda: self._guard(model), step)

    def _check_weights(self, model: nn.Module, parameters: Sequence[nn.Parameter]) -> None:
        self._weights = WeightCheck(model, parameters)

    def _selected(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        modules = select_modules(model, self.modules)
        if not modules:
            self.mode = self.mode.runtime_off()
            self.failures.warn_once(
                "no-modules", f"layerwatch: modules={list(self.modules or ())!r} matches no module of the model; "
                "the per-module families are off",
            )
        return modules

    def _guard(self, model: nn.Module) -> None:
        # When the forward raises, nothing of this step stays on the model (the exception may
        # leave the training loop, and nothing may come to disarm the step): not measured.
        self._forward_guard = FailedForwardGuard(model, self.disarm)

    def _arm_structure(self, model: nn.Module, forward_only: bool) -> None:
        self._structure = StructureProbe(model, training_only=not forward_only)

    def _arm_runtime(self, model: nn.Module, parameters: Sequence[nn.Parameter], forward_only: bool,
                     dense_limit: Optional[int]) -> None:
        modules = self._selected(model)
        if not modules:
            return
        families = self.families
        if self._structure is not None:  # FlopCounterMode slows every op of this step: its times would mislead
            families = tuple(f for f in families if f != Family.LATENCY)
        runtime = self._runtime = RuntimeProbe(
            modules, families=families, bins=self.bins, zeros=self.zeros, centered=self.centered, parameters=parameters,
            workspace=self.workspace, cuda_events=self._cuda_events, forward_only=forward_only,
        )
        structure = self._structure

        def aside(action: Callable[[], None]) -> None:  # out of every module's time, and of the table's MACs
            runtime.aside(action if structure is None else lambda: structure.uncounted(action))

        self._transformer.arm(model, modules, aside=aside if forward_only else None,
                              dense_limit=dense_limit)

    @property
    def sees_nonfinite(self) -> bool:
        """Whether this step's runtime probes are armed and flag NaN/Inf."""
        runtime = self._runtime
        return runtime is not None and not runtime.forward_only and Family.NONFINITE in self.families

    @property
    def hook_seconds(self) -> float:
        """Host time in the hooks of the step's own forward (a re-run's is in its own time)."""
        runtime = self._runtime
        return 0.0 if runtime is None or runtime.forward_only else runtime.hook_seconds

    def unhook(self) -> None:
        """Take this step's hooks off the model and keep what they measured, for :meth:`take`
        (a re-run is over: nothing of it stays on the model)."""
        for probe in (self._structure, self._runtime, self._forward_guard):
            if probe is not None:
                probe.remove()
        self._forward_guard = None
        self._transformer.unhook()

    def disarm(self) -> None:
        """Remove this step's hooks and drop what they measured (not the inert ones)."""
        for probe in (self._structure, self._runtime, self._forward_guard, self._transformer):
            if probe is not None:
                probe.remove()
        self._structure = self._runtime = self._forward_guard = self._weights = None

    def remove(self) -> None:
        """Remove every hook, the inert ones too (the engine is finishing)."""
        self.disarm()
        for probe in self._inert:
            probe.remove()
        self._inert = []
        self._transformer.release()

    def take(self, sync: Optional[RankSync] = None, step: int = -1, trained: bool = False,
             flattened: Optional[Mapping[str, tuple[int, torch.dtype, bool]]] = None
             ) -> tuple[Optional[Summary], Optional[ProbeResult]]:
        """Remove the hooks; the layer table (when a whole forward was seen) and the runtime
        measurements (when no probe failed). ``trained``: the step computed gradients (so the
        model ran: hooks that saw nothing were traced by Dynamo). ``flattened``: FSDP1's record
        of the parameters it flattened, for the table (:func:`~layerwatch.table.summary.add_parameters`).

        With ``sync`` (a sharded run: every rank calls this on every sampled step), the ranks
        first agree that each one's probes are on, worked and saw the same spread tensors; only
        then do they combine them. Where they do not, every rank turns its probes off alike,
        so none waits for another at a later step either.
        """
        weights, structure, runtime = self._weights, self._structure, self._runtime
        together = sync is not None and self._agree(sync, runtime, weights)
        if trained and self._ran_compiled():
            return self._keep_inert(sync, step)
        transformer = self._transformer.take(sync)
        self.disarm()
        summary = None if structure is None else self._table(structure, flattened)
        result = None if runtime is None else self._result(runtime, together, weights, transformer)
        return summary, result

    def _agree(self, sync: RankSync, runtime: Optional[RuntimeProbe], weights: Optional[WeightCheck]) -> bool:
        """Every rank, on every sampled step, whatever its own probes did: whether they all
        hold the same :class:`ProbeTerms` (one all_reduce) and worked. Where they do not, every
        rank turns its probes off alike."""
        healthy = runtime is not None and runtime.error is None
        checked = -1 if weights is None else weights.count  # the weights' check is combined too: the same on every rank
        runtime_on = self.mode.runtime_on
        terms = ProbeTerms(runtime_on, True, runtime.spread_work(), checked) if healthy else ProbeTerms(runtime_on)
        together = sync.same(terms.vector()) and healthy
        if not together and runtime_on:  # every rank alike: all turn them off
            self.mode = self.mode.runtime_off()
            if runtime is None:
                self.failures.warn_once("fail:probes", "layerwatch: the runtime probes could not be armed; the per-module families are off")
            elif runtime.error is None:
                runtime.fail(RuntimeError("the runtime probes failed on another rank"))
        return together

    def _table(self, structure: StructureProbe, flattened: Optional[Mapping[str, tuple[int, torch.dtype, bool]]]
               ) -> Optional[Summary]:
        """The layer table ``structure`` recorded, if it saw a whole forward (then, or when it
        failed, the table is no longer pending)."""
        if structure.error is not None:
            self.mode = self.mode.table_done()
            self.failures.warn_once("fail:structure", f"layerwatch: could not record the layer table: {structure.error!r}; skipped")
        elif structure.windows:
            summary = structure.summary(flattened)
            self.mode = self.mode.table_done()
            return summary
        return None

    def _result(self, runtime: RuntimeProbe, together: bool, weights: Optional[WeightCheck],
                transformer: Signals) -> Optional[ProbeResult]:
        """What ``runtime`` measured, with the ``transformer`` probes' signals; None when a
        probe failed (then the per-module families are off)."""
        result = None
        if runtime.error is None:
            try:
                result = runtime.result(together, weights=weights, transformer=transformer)
            except Exception as e:
                runtime.fail(e)
        if runtime.error is not None:
            self.mode = self.mode.runtime_off()
            self.failures.warn_once("fail:probes", f"layerwatch: a runtime probe failed: {runtime.error!r}; the per-module families are off")
        return result

    def found_compiled(self, step: int, trained: bool) -> bool:
        """Whether the step's forward, and the backward that ``trained`` says ran, went by this
        step's hooks unseen: the model runs inside compiled code (see the class). Its hooks stay
        then, inert, and it is measured on re-runs from now on. Before the optimizer step, so
        that this step can be run again with its own weights. Local: no collective."""
        if not (trained and self._ran_compiled()):
            return False
        self._keep_inert(None, step)
        return True

    def _ran_compiled(self) -> bool:
        """Whether this step's hooks, armed on the step's own forward, saw none of it: Dynamo
        traced them (the model runs inside a compiled function)."""
        runtime, structure = self._runtime, self._structure
        if self.mode.compiled or (runtime is None and structure is None) or (runtime is not None and runtime.forward_only):
            return False
        return (runtime is None or (runtime.error is None and not runtime.ran)) and \
            (structure is None or (structure.error is None and not structure.windows))

    def _keep_inert(self, sync: Optional[RankSync], step: int) -> tuple[None, None]:
        """The model ran inside compiled code (see the class): this step's hooks stay, inert,
        and from now on the model is measured on re-runs."""
        for probe in (self._structure, self._runtime):
            if probe is not None:
                probe.keep_inert()  # the runtime probe's gradient hooks go; none ran
                self._inert.append(probe)
        self._transformer.take(sync, keep_module_hooks=True)
        if self._forward_guard is not None:  # compiled code is guarded on the model's forward too
            self._inert.append(self._forward_guard)
        self._structure = self._runtime = self._forward_guard = self._weights = None
        self.mode = self.mode.runs_compiled()
        if is_writer_rank():
            self.failures.warn_once("compiled-caller", IN_A_COMPILED_CALLER.format(step=step))
        return None, None

