"""DeepSpeed ZeRO: where each parameter's weights and gradient lie on this rank.

ZeRO spreads what a parameter holds over the data-parallel ranks:

* **Stages 1 and 2** keep every rank's working (low-precision) weights whole. The fp32 master
  weights and the averaged gradients lie in flat partitions, one per parameter group and rank:
  a parameter's fragment of this rank's partition is ``p._hp_mapping`` (None where this rank
  holds none of it).
* **Stage 3** partitions the working weights too: outside its module's forward and backward,
  ``p`` is an empty placeholder, and ``p.ds_tensor`` this rank's slice of the flattened
  parameter (the last slices padded). Its fp32 master slice and gradient lie in the flat
  partitions of the optimizer's sub groups, where ``grad_position`` places them.

A ZeRO-1/2 parameter does not lead to its optimizer, and neither does the client optimizer: the
ZeRO optimizer is found from the DeepSpeed engine, from the ZeRO optimizer given, or from the
client optimizer (:func:`stepping_client`: the one whose ``.optimizer`` it is).

The gradient the optimizer steps with exists only inside DeepSpeed's ``step()``: as the
``.grad`` of one flat fp32 partition at a time, averaged over the ranks, unscaled and clipped,
just before DeepSpeed calls the client optimizer (the ``torch.optim.Optimizer`` it was given)
on it. So :class:`Zero` is read in that optimizer's step pre-hook (:meth:`Zero.stepping`), and
the weights from the fp32 master partitions. Nothing is gathered: every rank hands its pieces
to the same sharded reductions as FSDP's (:mod:`layerwatch.stats`), every rank listing every
parameter of the group, an empty piece where it holds none.

When the averaged gradients are not finite, DeepSpeed skips the step without calling the client
optimizer (in fp32 and bf16 a fault; under fp16's dynamic loss scale an expected overflow):
:meth:`Zero.skipped` reads its own flag.

No ``import deepspeed``: what is read is found on the objects themselves.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Optional, Sequence

import torch
from torch import nn

from layerwatch.distributed.sharding import NamedTensors, is_writer_rank, is_zero3_param
from layerwatch.guards.failures import FailurePolicy
from layerwatch.vocabulary import Family


def engine_of(model: nn.Module) -> Optional[nn.Module]:
    """``model`` when it is a ``DeepSpeedEngine`` (None when DeepSpeed was never imported)."""
    deepspeed = sys.modules.get("deepspeed")
    engine_type = getattr(deepspeed, "DeepSpeedEngine", None)
    return model if engine_type is not None and isinstance(model, engine_type) else None


def find_zero(model: nn.Module, deepspeed: Any, families: Sequence[str], failures: FailurePolicy,
              optimizer: Optional[torch.optim.Optimizer] = None) -> Optional["Zero"]:
    """:meth:`Zero.find`, and what it means for the run, said once on rank 0: what ZeRO-3 takes
    from the per-module probes, why a ZeRO-1/2 model's gradients cannot be read, or that
    ``optimizer`` (the one the front door hooks) is not the one DeepSpeed steps."""
    try:
        zero = Zero.find(model, deepspeed, optimizer)
    except ValueError as e:  # said in place of "no gradients": they are in DeepSpeed's partitions
        if is_writer_rank():
            failures.warn_once("no-grads", f"layerwatch: {e}; until then its gradients and update ratios are not measured")
        return None
    if zero is not None and optimizer is not None and zero.client is not optimizer and is_writer_rank():
        failures.warn_once(
            "zero-client",
            f"layerwatch: the optimizer given ({type(optimizer).__name__}) is not the one DeepSpeed ZeRO steps (its "
            f"{type(zero.client).__name__}), whose step hooks alone see the gradients: pass the optimizer given to "
            "deepspeed.initialize, or optimizer=engine.optimizer; until then gradients and update ratios are not measured",
        )
    if zero is not None and zero.stage == 3 and {Family.LATENCY, Family.NONFINITE} & set(families) and is_writer_rank():
        failures.warn_once(
            "zero3-hooks",
            "layerwatch: under DeepSpeed ZeRO-3 a parameter is an empty placeholder outside its module's forward and "
            "backward, and no hook may go on it: a module whose inputs need no gradient (the first layer) gets no "
            "backward time (bwd_ms) and no backward NaN/Inf flag. Its gradients are still measured and checked for "
            "NaN/Inf, in DeepSpeed's partitions",
        )
    return zero


def stepping_client(client: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> Optional[Any]:
    """DeepSpeed's ZeRO-1/2 optimizer that steps ``client`` (the optimizer given to
    ``deepspeed.initialize``: its ``.optimizer``), of the model whose ``params`` these are; None
    where none does (``client`` is another optimizer, or one DeepSpeed replaced).

    DeepSpeed links a ZeRO-1/2 parameter to its optimizer only under CPU offload
    (``p._zero_optimizer``). Otherwise nothing leads from the parameters or from the client to it:
    ``p._hp_mapping`` holds views of the flat fp32 partitions (the client's parameters) and
    DeepSpeed's gradient dicts; the engine's and the optimizer's hooks are closures. The ZeRO
    optimizer holds the client as its ``optimizer``, so the objects that refer to the client are
    searched, once at start and only for a model DeepSpeed linked: ``gc.get_referrers``, a walk
    over the collector's objects that neither runs nor changes it (about 0.1 s for the half million
    objects of a process that imported DeepSpeed); one that refers to the client is the ZeRO
    optimizer itself or the ``__dict__`` of its attributes, whose owner one walk more finds.
    Candidates are read through their ``__dict__`` alone: no code of theirs runs.
    """
    linked = next((p._zero_optimizer for p in params if getattr(p, "_zero_optimizer", None) is not None), None)
    if linked is not None and _steps(linked, client):
        return linked
    for referrer in gc.get_referrers(client):
        if type(referrer) is dict:
            if dict.get(referrer, "optimizer") is not client or "single_partition_of_fp32_groups" not in referrer:
                continue
            owners = [o for o in gc.get_referrers(referrer) if _instance_dict(o) is referrer]
        else:
            owners = [referrer]
        found = next((o for o in owners if _steps(o, client)), None)
        if found is not None:
            return found
    return None


def _instance_dict(obj: Any) -> Optional[dict]:
    """``obj``'s own attributes (no ``__getattr__`` or property of its runs); None where it has none."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None


def _steps(candidate: Any, client: torch.optim.Optimizer) -> bool:
    """Whether ``candidate`` is a ZeRO-1/2 optimizer (its partitions and group) stepping ``client``."""
    attributes = _instance_dict(candidate)
    return type(attributes) is dict and attributes.get("optimizer") is client and all(
        name in attributes for name in ("single_partition_of_fp32_groups", "dp_process_group", "bit16_groups"))


class Zero:
    """The ZeRO optimizer of a model and each parameter's pieces on this rank.

    Args:
        optimizer: DeepSpeed's ZeRO optimizer (``engine.optimizer``: stage 1, 2 or 3).
        stage: Its ZeRO stage.
    """

    def __init__(self, optimizer: Any, stage: int) -> None:
        self.optimizer = optimizer
        self.stage = stage
        self.client: torch.optim.Optimizer = optimizer.optimizer
        self.group = optimizer.dp_process_group
        import torch.distributed as dist

        self._rank = dist.get_rank(group=self.group)
        groups = optimizer.fp16_groups if stage == 3 else optimizer.bit16_groups
        self._group_of = {id(p): i for i, params in enumerate(groups) for p in params}

    @classmethod
    def find(cls, model: nn.Module, deepspeed: Any = None, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional["Zero"]:
        """The :class:`Zero` of ``model``, trained by a DeepSpeed engine with ZeRO: from
        ``deepspeed`` (the engine, or its ZeRO optimizer), from a ZeRO-3 parameter of ``model``, or
        from ``optimizer`` when it is the client optimizer a ZeRO-1/2 optimizer steps
        (:func:`stepping_client`); None where there is none (no DeepSpeed, or stage 0).

        Raises:
            ValueError: a ZeRO stage 1 or 2 model given without its engine, its ZeRO optimizer or
                the client optimizer (its parameters do not lead to it), or with another optimizer.
        """
        params = list(model.parameters())
        engine = engine_of(deepspeed) if deepspeed is not None else None
        zero_optimizer = getattr(engine, "optimizer", None) if engine is not None else deepspeed
        if zero_optimizer is None or not hasattr(zero_optimizer, "dp_process_group"):
            zero_optimizer = next((p._z3_optimizer for p in params if hasattr(p, "_z3_optimizer")), None)
        linked = any(hasattr(p, "_hp_mapping") for p in params)  # by a ZeRO-1/2 optimizer
        advice = ("pass the optimizer given to deepspeed.initialize (optimizer=opt) or optimizer=engine.optimizer, or "
                  "watch the engine itself (Inspector(engine))")
        if zero_optimizer is None and linked and optimizer is not None:
            zero_optimizer = stepping_client(optimizer, params)
            if zero_optimizer is None:
                raise ValueError(f"the model is trained by DeepSpeed ZeRO (stage 1 or 2), and the optimizer given "
                                 f"({type(optimizer).__name__}) is not the one it steps: {advice}")
        if zero_optimizer is not None and hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):
            return cls(zero_optimizer, 3)
        if zero_optimizer is not None and hasattr(zero_optimizer, "single_partition_of_fp32_groups"):
            return cls(zero_optimizer, 2 if getattr(zero_optimizer, "partition_gradients", False) else 1)
        if linked:
            raise ValueError(f"the model is trained by DeepSpeed ZeRO (stage 1 or 2), whose parameters do not lead to "
                             f"its optimizer: {advice}")
        return None

    def names(self, params: Sequence[tuple[str, nn.Parameter]]) -> list[str]:
        """The names of the parameters whose pieces ZeRO spreads over the ranks."""
        return [name for name, p in params if id(p) in self._group_of or is_zero3_param(p)]

    # ------------------------------------------------------------------ the step's group

    def stepping(self) -> Optional[int]:
        """The parameter group whose flat fp32 partition holds its gradient now: the one
        DeepSpeed is about to step with the client optimizer (in its step pre-hook); None
        outside DeepSpeed's step."""
        flats = self._flats()
        return next((i for i, flat in enumerate(flats) if flat.grad is not None), None)

    def stepping_params(self, params: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        """Those of ``params`` in the group DeepSpeed is about to step (none outside its step)."""
        group = self.stepping()
        return [] if group is None else [(name, p) for name, p in params if self._group_of.get(id(p)) == group]

    def skip_expected(self) -> Optional[bool]:
        """Whether the step DeepSpeed skipped, its averaged gradients not finite (its own flag: the
        client optimizer never ran, nor its hooks), was expected: None when it did not skip; True
        under fp16's dynamic loss scale (an overflow, ``stepped=False`` like a GradScaler's);
        False where the skip is a fault (fp32, bf16)."""
        if not getattr(self.optimizer, "overflow", False):
            return None
        return bool(getattr(self.optimizer, "dynamic_loss_scale", False))

    # ------------------------------------------------------------------ pieces

    def weights(self, params: Sequence[tuple[str, nn.Parameter]]) -> NamedTensors:
        """Each parameter's fp32 master weights on this rank (an empty piece where it holds none);
        a frozen ZeRO-3 parameter, which has no master weights, its working slice."""
        return [(name, self._piece(p, gradient=False)) for name, p in params]

    def gradients(self, params: Sequence[tuple[str, nn.Parameter]]) -> NamedTensors:
        """Each parameter's averaged gradient on this rank, of the group being stepped now
        (:meth:`stepping`); the parameters of other groups are left out."""
        group = self.stepping()
        return [(name, self._piece(p, gradient=True)) for name, p in params
                if group is not None and self._group_of.get(id(p)) == group and p.requires_grad]

    def flat_gradients(self) -> NamedTensors:
        """The flat fp32 gradient partition DeepSpeed is about to step with, this rank's, named for
        the sentinel's message: one tensor whatever the number of parameters (none outside its step)."""
        group = self.stepping()
        return [] if group is None else [(f"DeepSpeed's gradient partition of parameter group {group}", self._flats()[group].grad)]

    def _flats(self) -> list[torch.Tensor]:
        optimizer = self.optimizer
        return optimizer.fp32_partitioned_groups_flat if self.stage == 3 else optimizer.single_partition_of_fp32_groups

    def _piece(self, p: nn.Parameter, gradient: bool) -> torch.Tensor:
        group = self._group_of.get(id(p))
        if self.stage == 3:
            if group is None or self.optimizer.get_param_id(p) not in self.optimizer.grad_position:
                return self._working_slice(p)  # frozen: no master weights
            sub_group, offset, count = self.optimizer.grad_position[self.optimizer.get_param_id(p)]
            flat = self.optimizer.fp32_partitioned_groups_flat[sub_group]
            source = flat.grad if gradient else flat
            return source.narrow(0, offset, self._valid(p, count))
        mapping = getattr(p, "_hp_mapping", None)
        flat = self._flats()[group] if group is not None else None
        if mapping is None or flat is None:
            return torch.empty(0, dtype=torch.float32, device=p.device)
        address = mapping.get_hp_fragment_address()
        source = flat.grad if gradient else flat
        return source.narrow(0, address.start, address.numel)

    def _valid(self, p: nn.Parameter, count: int) -> int:
        """How many of the ``count`` values of this rank's ZeRO-3 slice of ``p`` are ``p``'s:
        the last slices are padded."""
        return max(0, min(count, p.ds_numel - self._rank * count))

    def _working_slice(self, p: nn.Parameter) -> torch.Tensor:
        part = p.ds_tensor
        return part.narrow(0, 0, self._valid(p, part.ds_numel))
