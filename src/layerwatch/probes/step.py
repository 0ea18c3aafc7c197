"""The module hooks of one sampled step: the layer table's, the first time, the runtime
probe's, and the traced probe's inside compiled code."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.distributed import RankSync
from layerwatch.failures import FailurePolicy
from layerwatch.hooks import FailedForwardGuard
from layerwatch.probes.transformer import TransformerProbes
from layerwatch.probes.runtime import ProbeResult, RuntimeProbe
from layerwatch.vocabulary import PROBE_FAMILIES
from layerwatch.probes.selection import (ModuleFilter, is_compiled, probe_names, select_modules,
                                         split_at_compiled)
from layerwatch.probes.shapes import CompiledTable
from layerwatch.probes.traced import TracedProbe
from layerwatch.probes.structure import StructureProbe
from layerwatch.probes.weights import WeightCheck
from layerwatch.table import Summary


COMPILED_CALLER = (
    "layerwatch: the model runs {how}; its hooks are compiled into the graph and measure activations, NaN/Inf and "
    "bytes on sampled steps. Per-module latency has no meaning inside fused kernels and is not recorded; the layer table "
    "waits for an eager forward."
)


class StepProbes:
    """The module hooks of a sampled step: the layer table (the first time), the runtime probes.

    Modules that run inside compiled code are measured by the traced probe (see
    :mod:`~layerwatch.probes.traced`), whose hooks are compiled into the graph and stay, gated,
    until :meth:`remove`. They must be on before the first compiled forward (:meth:`prepare`,
    when the run starts). Three ways the model is found to run compiled:

    * it holds ``torch.compile``'d parts (``torch.compile(module)``, ``module.compile()``): the
      modules inside them get the traced probe's hooks; the rest, and each compiled part as a
      whole, the runtime probe's, every sampled step;
    * the caller says it will compile it (the Hugging Face Trainer's ``torch_compile``): every
      module gets the traced probe's hooks;
    * it is called from compiled code (``torch.compile`` of a function that calls it): Dynamo
      traces the runtime probe's hooks, which then call the traced probe (its stand-ins on ``ahead``);
      those stay, calling only the traced probe, and later sampled steps arm it alone.

    Neither sees inside compiled code for the layer table. Where the model's own call runs
    eagerly (the first two ways, in one process), the shapes of its inputs are noted on the
    first sampled step and the table comes from one forward of them under fake tensors after
    it (:meth:`table_from_shapes`, :mod:`~layerwatch.probes.shapes`); else, or where that forward
    fails, it waits for an eager forward of a batch run again (:meth:`table_eagerly`).
    """

    def __init__(self, families: Sequence[str], modules: Optional[ModuleFilter], stats: Sequence[str], bins: int,
                 failures: FailurePolicy, output_head: Optional[str] = None) -> None:
        self.families, self.modules, self.bins, self.failures = families, modules, bins, failures
        self.zeros, self.centered = "zero_frac" in stats, "std" in stats
        self.structure_pending = "structure" in families
        self.runtime_on = any(family in families for family in PROBE_FAMILIES)
        self.table_waits = False  # the layer table of a compiled model waits: table_from_shapes, table_eagerly
        self._compiled_table = CompiledTable(failures)  # the table from the noted input shapes
        self._structure: Optional[StructureProbe] = None
        self._runtime: Optional[RuntimeProbe] = None
        self._transformer = TransformerProbes(families, output_head, failures)  # attention, log Z, kurtosis
        self._weights: Optional[WeightCheck] = None  # the weights' NaN/Inf check of this step
        self._forward_guard: Optional[FailedForwardGuard] = None
        self._inert: list[Any] = []
        self._traced: Optional[TracedProbe] = None
        self._outside: Optional[tuple[list[tuple[str, nn.Module]], list[str]]] = None  # compiled parts: (modules, regions)
        self._caller_compiled = False  # the model runs inside a compiled caller: the traced probe alone
        self._traced_alone = False  # armed, this step, without a runtime probe
        self.workspace = S.Workspace()  # kept from one sampled step to the next
        self._cuda_events: list[Any] = []  # the runtime probes' clock marks on a GPU, idem

    def arm(self, model: nn.Module, parameters: Sequence[nn.Parameter], step: int, writer: bool = True,
            structure: bool = True, eager: bool = False) -> None:
        """Arm this step's hooks: the layer table's (the first time, on the rank that writes,
        unless ``structure`` is False) and the runtime probes'. ``eager``: compiled code runs
        eagerly for this forward (a replay), so the eager hooks see every module."""
        writer = writer and structure
        runtime = self.runtime_on
        if eager:  # a replay's forwards are not the step's: noted no more
            self._compiled_table.unhook()
        if not ((self.structure_pending and writer) or runtime):
            return
        if runtime and "nonfinite" in self.families:  # before the forward: what its modules compute with
            self.failures.run("check the weights for NaN/Inf", lambda: self._check_weights(model, parameters), step)
        if not eager and (self._caller_compiled or self._outside is not None or is_compiled(model)):
            self.table_waits = self.structure_pending and writer
            if self.table_waits and is_compiled(model):
                self._compiled_table.note(model, step)
            if runtime:
                self.failures.run("arm the traced probes", lambda: self._arm_traced(model, parameters), step)
            return
        if self.structure_pending and writer:
            self.failures.run("record the layer table", lambda: self._arm_structure(model), step)
        if runtime:
            self.failures.run("arm the runtime probes", lambda: self._arm_runtime(model, parameters, eager), step)
        if self._structure is not None or self._runtime is not None:
            self.failures.run("guard the forward", lambda: self._guard(model), step)

    def _check_weights(self, model: nn.Module, parameters: Sequence[nn.Parameter]) -> None:
        self._weights = WeightCheck(model, parameters)

    def _arm_traced(self, model: nn.Module, parameters: Sequence[nn.Parameter]) -> None:
        if self._caller_compiled:
            self._traced.arm()
            self._transformer.arm_traced(model, self._traced)
            self._traced_alone = True
            return
        if self._outside is None:  # compiled since the run started
            self._attach_traced(model, parameters)
        outside, regions = self._outside
        self._traced.arm()
        self._transformer.arm_traced(model, self._traced)
        if not outside:
            self._traced_alone = True
            return
        self._runtime = RuntimeProbe(
            outside, families=self.families, bins=self.bins, zeros=self.zeros, centered=self.centered,
            parameters=parameters, workspace=self.workspace, cuda_events=self._cuda_events,
            traced=self._traced, regions=regions,
        )

    def _attach_traced(self, model: nn.Module, parameters: Sequence[nn.Parameter]) -> None:
        """The traced probe's hooks on the modules inside the model's compiled parts, for good."""
        outside, inside, regions = split_at_compiled(model, self._selected(model))
        self._traced = self._traced_probe(inside, parameters)
        self._traced.attach([module for _, module in inside])
        self._outside = (outside, regions)
        self.failures.warn_once(
            "compiled",
            "layerwatch: the model (or part of it) is torch.compile'd; on sampled steps, hooks compiled into its graph "
            f"measure the modules inside ({len(inside)}): activations, NaN/Inf and bytes. Per-module latency has no "
            "meaning inside fused kernels: each compiled part's time is logged as a whole, under its own name "
            f"({', '.join(regions) or 'none: module.compile() runs its hooks inside the graph'}). The layer table "
            "comes from one more forward of the first sampled step's input shapes under fake tensors, compiled code run "
            "eagerly (no compute, no recompile; in a single-process run); where that cannot be, from one eager forward "
            "of its batch where layerwatch can run it again (Lightning's callback, Inspector.replay_with); else call "
            "layerwatch.summarize(model._orig_mod, batch).",
        )

    def prepare(self, model: nn.Module, parameters: Sequence[nn.Parameter], compiled_by_caller: bool = False) -> None:
        """When the run starts, before the first forward (arming a sampled step then reads no
        tensor): a model with compiled parts gets the traced probe's hooks inside them; another,
        the traced probe the runtime probe's hooks call should Dynamo trace them (a compiled
        caller), or, with ``compiled_by_caller`` (the caller says it will compile the model), its
        hooks on every module. Hooks put on before the first compiled forward run in it, whichever
        step is sampled first."""
        if not self.runtime_on or self._outside is not None or self._caller_compiled:
            return
        if is_compiled(model):  # before its first compiled forward, whichever step is sampled first
            self._attach_traced(model, parameters)
            return
        modules = select_modules(model, self.modules)
        self._traced = self._traced_probe(modules, parameters, ahead=not compiled_by_caller)
        if compiled_by_caller:
            self._traced.attach([module for _, module in modules])
            self._outside = ([], [])
            self.failures.warn_once("compiled-caller", COMPILED_CALLER.format(how="compiled (torch.compile)"))

    def _selected(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        modules = select_modules(model, self.modules)
        if not modules:
            self.runtime_on = False
            self.failures.warn_once(
                "no-modules", f"layerwatch: modules={list(self.modules or ())!r} matches no module of the model; "
                "the per-module families are off",
            )
        return modules

    def _traced_probe(self, modules: Sequence[tuple[str, nn.Module]], parameters: Sequence[Any], ahead=False) -> TracedProbe:
        if self._traced is not None:  # its stand-ins go with it
            self._traced.remove()
        device = next((p.device for p in parameters), torch.device("cpu"))
        return TracedProbe(modules, families=self.families, bins=self.bins, zeros=self.zeros, centered=self.centered,
                           device=device, ahead=ahead)

    def table_from_shapes(self, model: nn.Module, step: int) -> Optional[Summary]:
        """The layer table of a compiled model from the input shapes its sampled step noted
        (:class:`~layerwatch.probes.shapes.CompiledTable`); None when none were noted (the table
        still waits) or that failed (said once; the caller may then try :meth:`table_eagerly`)."""
        table, failed = self._compiled_table.from_shapes(lambda forward: self.table_eagerly(model, step, forward), model)
        if failed:
            self.table_waits = self.structure_pending = True
        return table

    def table_eagerly(self, model: nn.Module, step: int, forward: Callable[[], Any]) -> Optional[Summary]:
        """The layer table of a compiled model, recorded while ``forward()`` runs its compiled
        code eagerly (the caller's doing); None when it could not be. Tried once."""
        self.structure_pending = self.table_waits = False
        self.failures.run("record the layer table", lambda: self._arm_structure(model), step)
        structure, self._structure = self._structure, None
        if structure is None:
            return None
        try:
            forward()
        finally:
            structure.remove()
        if structure.error is not None:
            self.failures.warn_once("fail:structure", f"layerwatch: could not record the layer table: {structure.error!r}; skipped")
        if structure.error is not None or not structure.windows:
            return None
        return structure.summary()

    def _guard(self, model: nn.Module) -> None:
        # When the forward raises, nothing of this step stays on the model (the exception may
        # leave the training loop, and nothing may come to disarm the step): not measured.
        self._forward_guard = FailedForwardGuard(model, self.disarm)

    def _arm_structure(self, model: nn.Module) -> None:
        self._structure = StructureProbe(model, training_only=True)

    def _arm_runtime(self, model: nn.Module, parameters: Sequence[nn.Parameter], eager: bool) -> None:
        modules = self._selected(model)
        if not modules:
            return
        families = self.families
        if self._structure is not None:  # FlopCounterMode slows every op of this step: its times would mislead
            families = tuple(f for f in families if f != "latency")
        traced = None
        if not eager:  # for a compiled caller, should Dynamo trace these hooks: clear until it does
            if self._traced is None or self._traced.names != probe_names(modules):
                self.prepare(model, parameters)
            traced = self._traced
            traced.armed = True
        self._runtime = RuntimeProbe(
            modules, families=families, bins=self.bins, zeros=self.zeros, centered=self.centered, parameters=parameters,
            workspace=self.workspace, cuda_events=self._cuda_events, traced=traced,
        )
        self._transformer.arm(model, modules)

    @property
    def sees_nonfinite(self) -> bool:
        """Whether this step's runtime probes are armed and flag NaN/Inf."""
        return (self._runtime is not None or self._traced_alone) and "nonfinite" in self.families

    @property
    def hook_seconds(self) -> float:
        """Host time in the runtime probes' hooks and the traced probe's operator (compiled code) this step."""
        return sum([probe.hook_seconds for probe in (self._runtime, self._traced) if probe is not None])

    def disarm(self) -> None:
        """Remove this step's hooks (not the inert or traced ones, which only stop recording)."""
        for probe in (self._structure, self._runtime, self._forward_guard, self._transformer):
            if probe is not None:
                probe.remove()
        self._compiled_table.unhook()
        self._structure = self._runtime = self._forward_guard = self._weights = None
        if self._traced is not None:
            self._traced.disarm()
        self._traced_alone = False

    def remove(self) -> None:
        """Remove every hook, the inert and traced ones too (the engine is finishing)."""
        self.disarm()
        for probe in self._inert:
            probe.remove()
        self._inert = []
        self._compiled_table.forget()
        if self._traced is not None:
            self._traced.remove()

    def take(self, sync: Optional[RankSync] = None, step: int = -1, trained: bool = False,
             flattened: Optional[Mapping[str, tuple[int, torch.dtype, bool]]] = None
             ) -> tuple[Optional[Summary], Optional[ProbeResult]]:
        """Remove the hooks; the layer table (when a whole forward was seen) and the runtime
        measurements (when no probe failed). ``trained``: the step computed gradients (so the
        model ran: hooks that saw nothing were not run). ``flattened``: FSDP1's record of the
        parameters it flattened, for the table (:func:`~layerwatch.table.add_parameters`).

        With ``sync`` (a sharded run: every rank calls this on every sampled step), the ranks
        first agree that each one's probes are on, worked and saw the same spread tensors; only
        then do they combine them. Where they do not, every rank turns its probes off alike,
        so none waits for another at a later step either.
        """
        weights = self._weights
        if self._traced_alone:
            traced = self._traced
            if sync is not None:  # before the transformer probes' exchange, as on every other rank's way
                sync.same([int(self.runtime_on), 1] + [0] * 6)  # what a healthy runtime probe with no spread work says
            transformer = self._transformer.take(sync)
            self.disarm()
            return None, _with_transformer(self._traced_result(traced, step, weights), transformer)
        structure, runtime = self._structure, self._runtime
        armed = [probe for probe in (structure, runtime) if probe is not None]
        compiled = any(probe.compiled for probe in armed)
        together = False
        if sync is not None:  # every rank, on every sampled step, whatever its own probes did
            healthy = runtime is not None and runtime.error is None
            checked = -1 if weights is None else weights.count  # the weights' check is combined too: the same on every rank
            work = runtime.spread_work() + [checked] if healthy and not compiled else [0] * 6
            together = sync.same([int(self.runtime_on), int(healthy)] + work) and healthy
            if not together and self.runtime_on:  # every rank alike: all turn them off
                self.runtime_on = False
                if runtime is None:
                    self.failures.warn_once("fail:probes", "layerwatch: the runtime probes could not be armed; the per-module families are off")
                elif runtime.error is None:
                    runtime.error = RuntimeError("the runtime probes failed on another rank")
        transformer = self._transformer.take(sync)
        if compiled:
            return self._caller_found(structure, runtime, step, weights)
        if trained and self._traced is not None and self._outside is None:  # the model ran eagerly
            self._traced.drop_attention()
        self.disarm()
        summary = result = None
        if structure is not None:
            if structure.error is not None:
                self.structure_pending = False
                self.failures.warn_once("fail:structure", f"layerwatch: could not record the layer table: {structure.error!r}; skipped")
            elif structure.windows:
                summary = structure.summary(flattened)
                self.structure_pending = False
        if runtime is not None:
            if runtime.error is None:
                try:
                    result = _with_transformer(runtime.result(together, weights=weights), transformer)
                except Exception as e:
                    runtime.error = e
            if runtime.error is not None:
                self.runtime_on = False
                self.failures.warn_once("fail:probes", f"layerwatch: a runtime probe failed: {runtime.error!r}; the per-module families are off")
        if result is not None and self._outside is not None:
            self._traced_ran(result, step)
        elif result is not None and not result.modules and self.runtime_on and trained:
            self.failures.warn_once(
                "no-hook-ran",
                f"layerwatch: no module hook ran on sampled step {step}. If the model is called from code compiled (torch.compile) "
                "before layerwatch attached, compiled code never runs hooks added later: attach layerwatch before the first "
                "compiled call, or call torch._dynamo.reset() before the next one so that it compiles again with them.",
            )
        return summary, result

    def _caller_found(self, structure: Optional[StructureProbe], runtime: Optional[RuntimeProbe], step: int,
                      weights: Optional[WeightCheck]) -> tuple[None, Optional[ProbeResult]]:
        """Dynamo traced this step's hooks: the model runs inside a compiled caller. The runtime
        probe's module hooks stay (compiled code runs them, and is guarded on them), and only
        call the traced probe from now on, which is armed alone: where compiled code falls back
        to eager (a graph break it cannot resume from), its eager ops measure those modules. This
        step's measurements are what either saw."""
        result = None
        if runtime is not None and runtime.error is None and self.runtime_on:
            try:
                result = runtime.result(keep_module_hooks=True, weights=weights)
            except Exception as e:
                self.failures.warn_once("fail:probes", f"layerwatch: a runtime probe failed: {e!r}; the per-module families are off")
                self.runtime_on = False
        armed = [probe for probe in (structure, runtime) if probe is not None]
        for probe in armed:
            probe.inert = True
        self._inert += armed
        if self._forward_guard is not None:  # compiled code is guarded on forward too
            self._inert.append(self._forward_guard)
        self._structure = self._runtime = self._forward_guard = None
        self.table_waits = structure is not None
        self.structure_pending = False
        self._caller_compiled = True
        self._traced_alone = False
        self.failures.warn_once("compiled-caller", COMPILED_CALLER.format(
            how="inside compiled code (torch.compile of a function that calls it)"))
        if self._traced is not None:  # not disarmed by a result (none, or a failed one)
            self._traced.disarm()
        if result is not None:
            self._traced_ran(result, step)
        return None, result

    def _traced_result(self, traced: TracedProbe, step: int, weights: Optional[WeightCheck]) -> Optional[ProbeResult]:
        try:
            result = traced.result(weights)
        except Exception as e:
            self.runtime_on = False
            self.failures.warn_once("fail:probes", f"layerwatch: a traced probe failed: {e!r}; the per-module families are off")
            return None
        self._traced_ran(result, step)
        return result

    def _traced_ran(self, result: ProbeResult, step: int) -> None:
        if self._traced is not None:
            self._traced.say_once(result, step, self.failures)


def _with_transformer(result: Optional[ProbeResult], transformer: tuple[dict, Optional[tuple], dict]) -> Optional[ProbeResult]:
    """``result`` with :meth:`TransformerProbes.take`'s attention, output logits and kurtosis."""
    if result is not None:
        result.attention, result.logits, result.kurtosis = transformer
    return result
