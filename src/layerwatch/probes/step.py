"""The module hooks of one sampled step: the layer table's, the first time, and the runtime
probe's."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from torch import nn

from layerwatch import stats as S
from layerwatch.distributed import RankSync
from layerwatch.failures import FailurePolicy
from layerwatch.hooks import FailedForwardGuard
from layerwatch.probes.runtime import ProbeResult, RuntimeProbe
from layerwatch.probes.selection import PROBE_FAMILIES, ModuleFilter, is_compiled, select_modules
from layerwatch.structure import StructureProbe, Summary


class StepProbes:
    """The module hooks of one sampled step: the layer table (the first time) and the
    runtime probes. Neither is armed on a compiled model (hooks would force a recompile
    and see nothing inside the graph); that is said once.

    A model called from compiled code (``torch.compile`` of a function that calls it) is
    found when Dynamo traces the first armed hooks. Those hooks then stay, inert, until
    :meth:`remove`: compiled code is guarded on the model's hooks, so removing them at the
    end of the step, or arming new ones later, would recompile it."""

    def __init__(self, families: Sequence[str], modules: Optional[ModuleFilter], stats: Sequence[str], bins: int,
                 failures: FailurePolicy) -> None:
        self.families, self.modules, self.bins, self.failures = families, modules, bins, failures
        self.zeros, self.centered = "zero_frac" in stats, "std" in stats
        self.structure_pending = "structure" in families
        self.runtime_on = any(family in families for family in PROBE_FAMILIES)
        self.off_for_compiled = False  # turned off because the model runs compiled: a replay still can
        self.table_waits = False  # the layer table of a compiled model waits for an eager forward (table_eagerly)
        self._structure: Optional[StructureProbe] = None
        self._runtime: Optional[RuntimeProbe] = None
        self._forward_guard: Optional[FailedForwardGuard] = None
        self._inert: list[Any] = []
        self.workspace = S.Workspace()  # kept from one sampled step to the next
        self._cuda_events: list[Any] = []  # the runtime probes' clock marks on a GPU, idem

    def arm(self, model: nn.Module, parameters: Sequence[nn.Parameter], step: int, writer: bool = True,
            structure: bool = True, eager: bool = False) -> None:
        """Arm this step's hooks: the layer table's (the first time, on the rank that writes,
        unless ``structure`` is False) and the runtime probes'. ``eager``: compiled code runs
        eagerly for this forward (a replay), so the hooks see inside a compiled model."""
        writer = writer and structure
        runtime = self.runtime_on or (eager and self.off_for_compiled)
        if not ((self.structure_pending and writer) or runtime):
            return
        if is_compiled(model) and not eager:
            self.off_for_compiled = self.runtime_on or self.off_for_compiled
            self.table_waits = self.structure_pending and writer
            self.runtime_on = False
            self.failures.warn_once(
                "compiled",
                "layerwatch: the model (or part of it) is torch.compile'd; module hooks cannot see inside a compiled "
                "graph, so the per-module families (latency, memory, activations, nonfinite) are not recorded on "
                "sampled steps. Parameter families and the NaN sentinel go on, and a NaN's step is replayed eagerly. "
                "The layer table comes from one eager forward of a sampled step's batch where layerwatch can run it "
                "again (Lightning's callback, Inspector.replay_with); else call "
                "layerwatch.summarize(model._orig_mod, batch).",
            )
            return
        if self.structure_pending and writer:
            self.failures.run("record the layer table", lambda: self._arm_structure(model), step)
        if runtime:
            self.failures.run("arm the runtime probes", lambda: self._arm_runtime(model, parameters), step)
        if self._structure is not None or self._runtime is not None:
            self.failures.run("guard the forward", lambda: self._guard(model), step)

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
        # The model's forward raised: nothing of this step stays on the model (the exception
        # may leave the training loop, and nothing may come to disarm the step), and the step
        # is not measured.
        self._forward_guard = FailedForwardGuard(model, self.disarm)

    def _arm_structure(self, model: nn.Module) -> None:
        self._structure = StructureProbe(model, training_only=True)

    def _arm_runtime(self, model: nn.Module, parameters: Sequence[nn.Parameter]) -> None:
        modules = select_modules(model, self.modules)
        if not modules:
            self.runtime_on = False
            self.failures.warn_once(
                "no-modules", f"layerwatch: modules={list(self.modules or ())!r} matches no module of the model; "
                "the per-module families are off",
            )
            return
        families = self.families
        if self._structure is not None:  # FlopCounterMode slows every op of this step: its times would mislead
            families = tuple(f for f in families if f != "latency")
        self._runtime = RuntimeProbe(
            modules, families=families, bins=self.bins, zeros=self.zeros, centered=self.centered, parameters=parameters,
            workspace=self.workspace, cuda_events=self._cuda_events,
        )

    @property
    def sees_nonfinite(self) -> bool:
        """Whether this step's runtime probes are armed and flag NaN/Inf."""
        return self._runtime is not None and "nonfinite" in self.families

    @property
    def hook_seconds(self) -> float:
        """Host time the runtime probes' hooks have spent so far this step."""
        return 0.0 if self._runtime is None else self._runtime.hook_seconds

    def disarm(self) -> None:
        """Remove this step's hooks (not the inert ones)."""
        for probe in (self._structure, self._runtime, self._forward_guard):
            if probe is not None:
                probe.remove()
        self._structure = self._runtime = self._forward_guard = None

    def remove(self) -> None:
        """Remove every hook, the inert ones too (the engine is finishing)."""
        self.disarm()
        for probe in self._inert:
            probe.remove()
        self._inert = []

    def take(self, sync: Optional[RankSync] = None) -> tuple[Optional[Summary], Optional[ProbeResult]]:
        """Remove the hooks; the layer table (when a whole forward was seen) and the runtime
        measurements (when no probe failed).

        With ``sync`` (a sharded run: every rank calls this on every sampled step), the ranks
        first agree that each one's probes are on, worked and saw the same spread tensors; only
        then do they combine them. Where they do not, every rank turns its probes off alike,
        so none waits for another at a later step either.
        """
        structure, runtime = self._structure, self._runtime
        armed = [probe for probe in (structure, runtime) if probe is not None]
        compiled = any(probe.compiled for probe in armed)
        together = False
        if sync is not None:  # every rank, on every sampled step, whatever its own probes did
            healthy = runtime is not None and runtime.error is None and not compiled
            work = runtime.spread_work() if healthy else [0] * 5
            together = sync.same([int(self.runtime_on), int(healthy)] + work) and healthy
            if not together and self.runtime_on and not compiled:  # every rank alike: all turn them off
                self.runtime_on = False
                if runtime is None:
                    self.failures.warn_once("fail:probes", "layerwatch: the runtime probes could not be armed; the per-module families are off")
                elif runtime.error is None:
                    runtime.error = RuntimeError("the runtime probes failed on another rank")
        if compiled:
            for probe in armed:
                probe.inert = True
            self._inert += armed
            if self._forward_guard is not None:  # compiled code is guarded on forward too
                self._inert.append(self._forward_guard)
            self._structure = self._runtime = self._forward_guard = None
            self.off_for_compiled = self.runtime_on or self.off_for_compiled
            self.table_waits = structure is not None
            self.structure_pending = self.runtime_on = False
            self.failures.warn_once(
                "compiled-caller",
                "layerwatch: the model runs inside compiled code (torch.compile of a function that calls it), where "
                "module hooks do not run; the layer table and the per-module families (latency, memory, "
                "activations, nonfinite) are not recorded. Parameter families and the NaN sentinel go on.",
            )
            return None, None
        self.disarm()
        summary = result = None
        if structure is not None:
            if structure.error is not None:
                self.structure_pending = False
                self.failures.warn_once("fail:structure", f"layerwatch: could not record the layer table: {structure.error!r}; skipped")
            elif structure.windows:
                summary = structure.summary()
                self.structure_pending = False
        if runtime is not None:
            if runtime.error is None:
                try:
                    result = runtime.result(together)
                except Exception as e:
                    runtime.error = e

            if runtime.error is not None:
                self.runtime_on = False
                self.failures.warn_once("fail:probes", f"layerwatch: a runtime probe failed: {runtime.error!r}; the per-module families are off")
        return summary, result