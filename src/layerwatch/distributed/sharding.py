"""Which rank does what; sharded tensors (FSDP2, DTensor, tensor parallel, FSDP1) measured
without gathering them; and the rule that keeps a distributed run from hanging.

**Collectives are symmetric.** Every collective layerwatch issues is issued by every rank of
its group, in the same order, or by none. Code that may run on one rank alone (rank 0's
writing, a probe's hook) reads local data only: a DTensor's local tensor, never an op on the
DTensor itself, which may hide a collective (its ``norm`` or ``sum`` is ``Partial``, and
writing that into a plain tensor all-reduces it). Where a sampled step's collectives could
come apart (one rank's probe failed, one rank's list of tensors differs), the ranks first
agree on what follows (:meth:`RankSync.same`), and all of them skip it when they do not.

A run is *sharded* when it is distributed and some parameter is spread over the ranks (a
DTensor, or an FSDP1 flat parameter). Then every rank takes part in every sampled step
(probes, reductions), and the ranks decide together which steps are sampled
(:class:`StepVote`). Under DDP, rank 0 alone measures: no sampled step issues a collective
for its measurements (the overhead budget shares rank 0's interval: :meth:`RankSync.broadcast`).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from layerwatch.vocabulary import ROOT

NamedTensors = Sequence[tuple[str, torch.Tensor]]
Group = tuple[Any, list[str], list[torch.Tensor]]  # (process group or None, names, local tensors)

# What module wrappers put into qualified names; FSDP's own state dict leaves them out too, and
# torch.compile's OptimizedModule holds the module it compiled as ``_orig_mod``.
WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def innermost(module: nn.Module) -> nn.Module:
    """The module that ``torch.compile``'s and DDP's wrappers hold (DDP's forward would broadcast
    its buffers: the inner module's issues no collective)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        elif isinstance(module, DistributedDataParallel):
            module = module.module
        else:
            return module


def initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def is_writer_rank() -> bool:
    """Rank 0 writes; every rank takes part in the reductions of sharded tensors."""
    import torch.distributed as dist

    return not initialized() or dist.get_rank() == 0


def global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if initialized() else 1


@functools.cache
def _dtensor_type() -> Union[type, tuple[()]]:
    """DTensor's class, or ``()`` on a torch without distributed (``isinstance(x, ())`` is False)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ()
    return DTensor


def is_dtensor(tensor: Any) -> bool:
    return isinstance(tensor, _dtensor_type())


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds, read without DTensor's dispatch (no collective,
    no autograd node): a DTensor's local tensor, detached; any other tensor itself."""
    return tensor._local_tensor.detach() if isinstance(tensor, _dtensor_type()) else tensor


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local` of each tensor, without a Python call per tensor."""
    dtensor = _dtensor_type()
    return [t._local_tensor.detach() if isinstance(t, dtensor) else t for t in tensors]


@dataclass(frozen=True)
class Spread:
    """How a DTensor's values lie over its group's ranks, as far as statistics care:
    ``"shard"`` (each rank holds different values), ``"partial"`` (each holds a term of
    every value) or ``"several"`` (sharded along more than one mesh dimension: not measured)."""

    kind: str
    group: Any = None


def spread(tensor: torch.Tensor) -> Optional[Spread]:
    """Whether ``tensor`` is spread over ranks (None: replicated, or a plain tensor). Reads
    placements only."""
    if not isinstance(tensor, _dtensor_type()):
        return None
    dims = [(i, p) for i, p in enumerate(tensor.placements) if not p.is_replicate()]
    if not dims:
        return None
    if len(dims) > 1:
        return Spread("several")
    dim, placement = dims[0]
    group = tensor.device_mesh.get_group(dim)
    if group is None or group.size() == 1:
        return None
    return Spread("shard" if placement.is_shard() else "partial", group)


def clean_name(name: str) -> str:
    """A qualified name without the wrappers' parts (``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``, torch.compile's ``_orig_mod``), as FSDP's state dict spells
    it: ``layers.0.weight``, compiled or not."""
    if "_wrapped_module" not in name and "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


@functools.cache
def _wrapper_types() -> tuple[type, ...]:
    types: list[type] = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        types.append(FullyShardedDataParallel)
    except ImportError:
        pass
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

        types.append(ActivationWrapper)
    except ImportError:
        pass
    return tuple(types)


def is_wrapper(module: nn.Module) -> bool:
    """An FSDP1, checkpoint or torch.compile wrapper: its wrapped module is the layer, under the
    same name."""
    return isinstance(module, _all_wrapper_types())


def _all_wrapper_types() -> tuple[type, ...]:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported once anything was compiled
    return _wrapper_types() + (() if eval_frame is None else (eval_frame.OptimizedModule,))


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` without the wrappers, under their clean names."""
    wrappers = _all_wrapper_types()
    return [(name if "_wrapped_module" not in name and "_orig_mod" not in name else clean_name(name), module)
            for name, module in walk(model) if not isinstance(module, wrappers)]


_TORCH_NAMED_MODULES, _TORCH_NAMED_PARAMETERS = nn.Module.named_modules, nn.Module.named_parameters


def walk(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(model.named_modules())``: each module once, depth first, under its qualified name,
    in one frame (torch's recursion resumes a generator per module and per ancestor, each a
    Python call: a sampled step walks the model several times). A model with a module that walks
    its own way (its class's ``named_modules``, or one set on it) is walked by its own ``named_modules``."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack = [("", model)]
    while stack:
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        if type(module).named_modules is not _TORCH_NAMED_MODULES or "named_modules" in module.__dict__:
            return list(model.named_modules())
        seen.add(id(module))
        out.append((prefix, module))
        children = module._modules
        if children:
            base = prefix + "." if prefix else ""
            for name in reversed(children):  # popped in their order
                child = children[name]
                if child is not None:
                    stack.append((base + name, child))
    return out


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``list(model.named_parameters())`` in one frame (see :func:`walk`); a model whose class
    names its parameters its own way (FSDP1's) by its own ``named_parameters``."""
    if type(model).named_parameters is not _TORCH_NAMED_PARAMETERS or "named_parameters" in model.__dict__:
        return list(model.named_parameters())
    out: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for prefix, module in walk(model):
        base = prefix + "." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((base + name, p))
    return out


# ---------------------------------------------------------------------- the parameters' layout


@dataclass
class Layout:
    """How a model's parameters lie over the ranks.

    ``pieces`` maps the clean name of each FSDP1 parameter (``use_orig_params=True``) to its
    unit's process group and flat parameter: the parameter itself is this rank's piece of it
    (empty on a rank that holds none of it). ``flat_only`` names the FSDP1 units wrapped with
    ``use_orig_params=False``: their flat parameters hold several parameters each and are not
    measured. ``flattened`` is what FSDP1 records of every parameter it flattened, by clean
    name: the whole parameter's number of elements, dtype and ``requires_grad`` (for the layer
    table: no module holds more than a piece of it, or with ``use_orig_params=False`` anything).
    """

    sharded: bool = False
    pieces: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    flattened: dict[str, tuple[int, torch.dtype, bool]] = field(default_factory=dict)
    flat_only: list[str] = field(default_factory=list)
    staged: bool = False  # pipeline stages (engine/stages.py): each rank holds parameters no other stage has, and measures them

    def parameters(self, model: Optional[nn.Module]) -> list[tuple[str, nn.Parameter]]:
        """The model's named parameters that hold values, under clean names; an FSDP1
        parameter also where this rank's piece of it is empty (every rank lists it)."""
        if model is None:
            return []
        out = []
        for name, p in named_parameters(model):
            if getattr(p, "_is_flat_param", False):
                continue
            name = clean_name(name)
            if p.numel() > 0 or name in self.pieces:
                out.append((name, p))
        return out

    def missing_gradient(self, name: str, p: nn.Parameter) -> Optional[torch.Tensor]:
        """For the FSDP1 parameter ``name`` whose gradient is None while its unit has one (this
        rank's piece of it is empty): an empty gradient, so that every rank of the unit
        reduces the same list. None otherwise."""
        flat = self.pieces[name][1]
        return p.new_empty(0) if flat.grad is not None and p.requires_grad else None


def parameter_layout(model: Optional[nn.Module], within: Optional[nn.Module] = None, zero: Any = None) -> Layout:
    """The :class:`Layout` of ``model``'s parameters on this rank. ``within``: a module that
    wraps ``model`` (Lightning's ``strategy="fsdp"`` wraps the LightningModule itself in
    FSDP), whose FSDP units hold some of its parameters too. ``zero``: the
    :class:`~layerwatch.measure.zero.Zero` of a DeepSpeed ZeRO run, whose parameters are pieces over
    its data-parallel group (their pieces are the family's to find: no flat parameter)."""
    result = Layout()
    if model is None or world_size() == 1:
        return result
    if zero is not None:
        result.sharded = True
        result.pieces = {name: (zero.group, None) for name in zero.names(list(model.named_parameters()))}
        return result
    root = model if within is None else within
    prefix = next((clean_name(name) for name, module in root.named_modules() if module is model), "")
    for name, module in root.named_modules():
        handle = getattr(module, "_handle", None) if is_wrapper(module) else None
        flat = getattr(handle, "flat_param", None)
        if flat is None or not getattr(handle, "uses_sharded_strategy", False):
            continue
        result.sharded = True
        unit = clean_name(name)
        names = [_relative(clean_name(f"{unit}.{fqn}" if unit else fqn), prefix) for fqn in flat._fqns]
        result.flattened.update((name, (numel, flat.dtype, flat.requires_grad)) for name, numel in zip(names, flat._numels))
        if not getattr(handle, "_use_orig_params", False):
            result.flat_only.append(_relative(unit, prefix) or ROOT)
            continue
        for name in names:
            result.pieces[name] = (handle.process_group, flat)
    dtensor = _dtensor_type()
    result.sharded = result.sharded or any(isinstance(p, dtensor) for p in model.parameters())
    return result


def _relative(name: str, prefix: str) -> str:
    return name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name


def this_ranks_groups(pairs: NamedTensors, warn_once: Callable[[str, str], None], layout: Optional[Layout] = None) -> list[Group]:
    """``(group, names, tensors)`` this rank reduces: sharded tensors (local shards, or FSDP1
    pieces) with their process group on every rank, then the rest by device (group None) on
    rank 0, or on every rank when the layout is ``staged`` (each holds its own stage's).

    A DTensor sharded along one mesh dimension is reduced over that dimension's process
    group; replicated DTensors (and those of a group of one rank) count as plain: their local
    tensor is the whole tensor. ``Partial`` ones (each rank holds a term of every value) and
    those sharded along several mesh dimensions are not measured, said once each.
    """
    plain: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    sharded: dict[Any, tuple[list[str], list[torch.Tensor]]] = {}
    writer = is_writer_rank() or (layout is not None and layout.staged)
    dtensor = _dtensor_type()
    pieces = {} if layout is None else layout.pieces
    for name, tensor in pairs:
        group = None
        if isinstance(tensor, dtensor):
            how = spread(tensor)
            if how is not None and how.kind != "shard":
                what = "of partial values (each rank holds a term of each)" if how.kind == "partial" else "sharded along several mesh dimensions"
                warn_once(f"spread:{name}", f"layerwatch: {name!r} is a DTensor {what}; not measured")
                continue
            group, tensor = None if how is None else how.group, local(tensor)
        elif name in pieces:
            group = pieces[name][0]
        if group is not None:
            names, shards = sharded.setdefault(group, ([], []))
            names.append(name)
            shards.append(tensor.detach())
        elif writer:
            names, tensors = plain.setdefault(tensor.device, ([], []))
            names.append(name)
            tensors.append(tensor)
    groups = [(group, names, shards) for group, (names, shards) in sharded.items()]
    return groups + [(None, names, tensors) for names, tensors in plain.values()]


FAILED_NORM = -1.0  # what a norm reads on every rank when a rank could not take its part


def norms(tensors: Optional[list[torch.Tensor]], group: Any = None, count: int = 0,
          device: Optional[torch.device] = None) -> torch.Tensor:
    """L2 norms (float64); of whole sharded tensors when ``group`` holds their shards.
    ``tensors=None``: this rank could not read its ``count`` shards (on ``device``); it still
    takes part in the reduction, and every rank's norms read ``FAILED_NORM``."""
    if group is None:
        return torch.stack(_foreach_norm(tensors)).to(torch.float64)  # stack promotes mixed dtypes
    import torch.distributed as dist

    try:
        squares = torch.stack(_foreach_norm(tensors)).to(torch.float64) ** 2
        failed = 0.0
    except Exception:  # no shards (None), or they could not be read: take part all the same
        squares, failed = torch.zeros(count, dtype=torch.float64, device=device), 1.0
    squares = torch.cat([squares, squares.new_full((1,), failed)])
    dist.all_reduce(squares, group=group)
    return torch.where(squares[-1] > 0, FAILED_NORM, squares[:-1].sqrt())


def _foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``torch._foreach_norm``, in float32 for 16-bit tensors (in their own dtype a bfloat16 norm
    keeps 3 digits, and a float16 one overflows past 65504); a torch whose kernel takes no
    ``dtype`` gives their own."""
    if tensors and all(t.dtype in (torch.bfloat16, torch.float16) for t in tensors):
        try:
            return torch._foreach_norm(tensors, 2, dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return torch._foreach_norm(tensors)


def is_zero3_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ZeRO-3 parameter: outside its module's forward and backward an empty
    placeholder, which no hook may be put on."""
    return hasattr(p, "ds_id")
