"""Where a model's parameters live over the ranks: DeepSpeed ZeRO's partitions, FSDP's shards,
pipeline stages; whether each rank routes its own batch through MoE routers.

:func:`find_placement` looks once, at the start of a run, on every rank at the same point
(finding the stages is collective). What it finds decides how a sample is read
(:class:`~layerwatch.distributed.sharding.Layout`, :class:`~layerwatch.measure.zero.Zero`) and whether the ranks
sample together (:attr:`Placement.together`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from torch import nn

from layerwatch.distributed.sharding import Layout, innermost, is_writer_rank, parameter_layout, world_size
from layerwatch.guards.failures import FailurePolicy
from layerwatch.options import Options
from layerwatch.probes import StepProbes, probe_name, select_modules
from layerwatch.probes.routers import find_routers
from layerwatch.vocabulary import Family
from layerwatch.engine.stages import Held, Stages, find_stages
from layerwatch.measure.zero import Zero, find_zero


@dataclass
class Placement:
    """Where the parameters live: their layout, a ZeRO run's partitions, pipeline stages."""

    layout: Layout
    zero: Optional[Zero] = None
    stages: Optional[Stages] = None
    routed: bool = False  # a distributed model with MoE routers: each rank routes its own batch

    @property
    def together(self) -> bool:
        """Every rank takes part in every sampled step, and the ranks vote on which steps those
        are: a sharded run, pipeline stages, or a model whose routers' counts are added over
        the ranks (data parallel: each routes its own batch)."""
        return self.layout.sharded or self.stages is not None or self.routed

    @property
    def collective(self) -> bool:
        """The ranks' forward is collective (sharded parameters, pipeline stages): no rank may
        stop one alone. A data-parallel model's forward with routers is each rank's own."""
        return self.layout.sharded or self.stages is not None


def find_placement(model: Optional[nn.Module], within: Optional[nn.Module], deepspeed: Any, options: Options,
                   probes: StepProbes, failures: FailurePolicy, optimizer: Any = None) -> Placement:
    """The :class:`Placement` of ``model``'s parameters on this rank (``within``: a module that
    wraps it; ``deepspeed``: the DeepSpeed engine that trains it; ``optimizer``: the one the front
    door hooks, which leads to a ZeRO-1/2 optimizer that steps it). In a distributed run, call it
    on every rank at the same point."""
    distributed = model is not None and world_size() > 1
    zero = failures.run("find DeepSpeed ZeRO's partitions",
                        lambda: find_zero(model, deepspeed, options.families, failures, optimizer), 0) if distributed else None
    layout = parameter_layout(model, within, zero)
    stages = failures.run("find the pipeline stages (only rank 0's layers are measured)",  # every rank: collective
                          lambda: _find_stages(layout, model, options, probes, failures), 0) if distributed else None
    routed = distributed and Family.MOE in options.families and failures.run(
        "find the MoE routers", lambda: bool(find_routers(innermost(model), options.moe_routers)), 0, otherwise=False)
    placement = Placement(replace(layout, staged=True) if stages is not None else layout, zero, stages, bool(routed))
    if placement.layout.flat_only and is_writer_rank():
        failures.warn(
            f"layerwatch: FSDP wraps {', '.join(placement.layout.flat_only)} with use_orig_params=False, so their "
            "parameters exist only as flat parameters that each hold many of them, and are not measured; "
            "per-parameter statistics (weights, grads, updates) need FullyShardedDataParallel(..., "
            "use_orig_params=True). The per-module families go on."
        )
    return placement


def _find_stages(layout: Layout, model: nn.Module, options: Options, probes: StepProbes,
                 failures: FailurePolicy) -> Optional[Stages]:
    modules = tuple(probe_name(name) for name, _ in select_modules(model, options.modules))
    stages = find_stages(Held(tuple(name for name, _ in layout.parameters(model)), modules, layout.sharded), failures)
    if stages is not None and probes.structure_pending:
        if is_writer_rank():
            failures.warn("layerwatch: the model is split into pipeline stages, and each rank runs one stage's "
                          "forward, so the layer table of the whole model is not recorded (layerwatch/structure); "
                          "call layerwatch.summarize(model, batch) on the whole model before it is split")
        probes.forgo_layer_table()
    return stages
