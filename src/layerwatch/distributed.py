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
import struct
import sys
import zlib
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


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def is_writer_rank() -> bool:
    """Rank 0 writes; every rank takes part in the reductions of sharded tensors."""
    import torch.distributed as dist

    return not _initialized() or dist.get_rank() == 0


def global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if _initialized() else 1


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
    staged: bool = False  # pipeline stages (stages.py): each rank holds parameters no other stage has, and measures them

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
    :class:`~layerwatch.zero.Zero` of a DeepSpeed ZeRO run, whose parameters are pieces over
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
        return torch.stack(torch._foreach_norm(tensors)).to(torch.float64)  # stack promotes mixed dtypes
    import torch.distributed as dist

    try:
        squares = torch.stack(torch._foreach_norm(tensors)).to(torch.float64) ** 2
        failed = 0.0
    except Exception:  # no shards (None), or they could not be read: take part all the same
        squares, failed = torch.zeros(count, dtype=torch.float64, device=device), 1.0
    squares = torch.cat([squares, squares.new_full((1,), failed)])
    dist.all_reduce(squares, group=group)
    return torch.where(squares[-1] > 0, FAILED_NORM, squares[:-1].sqrt())


def fingerprint(names: Sequence[str]) -> int:
    """A number that is the same on every rank exactly when ``names`` is (up to CRC collisions)."""
    return zlib.crc32("\0".join(names).encode())


# ---------------------------------------------------------------------- agreeing


class RankSync:
    """A CPU group of the whole world (gloo: no device sync, whatever the training's backend)
    where the ranks agree: a sharded run's, made at its start and kept; or one made for a few
    exchanges and closed after (a context manager). Every rank makes it at the same point:
    making a group is itself collective. With ``timeout_s``, a rank that never comes to an
    exchange makes the others raise after that long instead of waiting for it."""

    def __init__(self, timeout_s: Optional[float] = None) -> None:
        import datetime

        import torch.distributed as dist

        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout)

    def same(self, values: Sequence[int]) -> bool:
        """Whether every rank passed the same ``values`` (as many on every rank): one all_reduce."""
        import torch.distributed as dist

        both = torch.tensor(list(values) + [-v for v in values], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        n = len(values)
        return bool((both[:n] == -both[n:]).all())

    def broadcast(self, values: Sequence[int]) -> list[int]:
        """Global rank 0's ``values`` on every rank: one broadcast of a few ints, one read."""
        import torch.distributed as dist

        shared = torch.tensor(list(values), dtype=torch.int64)
        dist.broadcast(shared, src=0, group=self.group)
        return shared.tolist()

    def all(self, obj: Any) -> list[Any]:
        """``obj`` (a small picklable object) from every rank, in rank order."""
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        group, self.group = self.group, None
        if group is not None and _initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # the run's own group is gone already: so is this one
                pass

    remove = close  # as the engine's attachments release what they hold

    def __enter__(self) -> "RankSync":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class Ballot:
    """One rank's say on one step: rank 0's schedule; a sample this rank asks for (a NaN/Inf
    finding not sampled yet); its sentinel's first finding, if any (its step, and whether a
    value was NaN); and the oldest loss it has that the ranks have not voted on (its step and
    value: the spike check's, see :class:`~layerwatch.spikes.Spikes`)."""

    scheduled: bool
    forced: bool = False
    finding_step: Optional[int] = None
    finding_nan: bool = False
    loss: Optional[tuple[int, float]] = None
    loss_pending: bool = False  # no loss to give yet, but some coming (the others wait); neither: it has none (a stage)


@dataclass
class Decision:
    """What the ranks decided for one step: sampled or not, whether a rank asked for it beyond
    the schedule (``forced``), the earliest NaN/Inf finding of any rank (its step; NaN, or
    only Inf), if one came in, and the largest of the ranks' losses of one step, when every
    rank sent its loss of that step (else None: they vote again; ``losses_from``, when every
    rank sent one but of different steps: the latest, the others lacking the steps before it)."""

    sampled: bool
    finding_step: Optional[int] = None
    finding_nan: bool = False
    forced: bool = False
    loss: Optional[tuple[int, float]] = None
    losses_from: Optional[int] = None


_NO_FINDING = 1 << 62
_PENDING = 1 << 62  # a loss's step past any step: a rank waits for its loss
_NO_LOSS = -(1 << 62)  # before any step: a rank that has no loss to give
_INT64_MIN = -(1 << 63)


def _orderable(value: float) -> int:
    """``value``'s float64 bits as an int64 that orders as the floats do (a MAX of ints is a MAX of floats)."""
    bits = struct.unpack("<q", struct.pack("<d", value))[0]
    return bits if bits >= 0 else bits ^ 0x7FFFFFFFFFFFFFFF


def _from_orderable(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits if bits >= 0 else bits ^ 0x7FFFFFFFFFFFFFFF))[0]


class StepVote:
    """Each step's sampling decision, the same on every rank of a sharded run.

    At step ``k`` every rank sends its :class:`Ballot` for step ``k + 1`` (one small
    all_reduce, started without waiting for it) and takes the result for step ``k``, sent
    a step before. The wait is a step's compute after the send: it is over by then. A step
    with no ballot sent ahead (the first, or after a jump in the step count) is decided at
    once.
    """

    def __init__(self, sync: RankSync) -> None:
        self._sync = sync
        self._pending: Optional[tuple[int, torch.Tensor, Any]] = None

    def decide(self, step: int, ballot: Callable[[int], Ballot]) -> Decision:
        """The decision for ``step``: the ballots sent for it a step before, or, when none
        were, ``ballot(step)`` of every rank, at once."""
        decided = self._take(step)
        if decided is None:
            self.send(step, ballot(step))
            decided = self._take(step)
        return decided

    def send(self, step: int, ballot: Ballot) -> None:
        """Send this rank's ballot for ``step`` (a later step than any decided)."""
        import torch.distributed as dist

        self._take(None)
        # The earliest finding wins the MAX, and at one step a NaN over an Inf: -(2 step + not NaN).
        finding = _NO_FINDING if ballot.finding_step is None else 2 * ballot.finding_step + (not ballot.finding_nan)
        # A loss's step, MAXed and MIN-ed (as -step) over the ranks that have one: the same on every rank,
        # or no loss is taken; a rank waiting for its loss holds the others back, one without any stands aside.
        if ballot.loss is not None:
            latest, earliest, loss = ballot.loss[0], -ballot.loss[0], _orderable(ballot.loss[1])
        else:
            latest, earliest, loss = (_PENDING if ballot.loss_pending else _NO_LOSS), _NO_LOSS, _INT64_MIN
        votes = torch.tensor([int(ballot.scheduled), int(ballot.forced), -finding, latest, earliest, loss],
                             dtype=torch.int64)
        work = dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self._sync.group, async_op=True)
        self._pending = (step, votes, work)

    def remove(self) -> None:
        """Wait for the ballot in flight (every rank has sent it), then close the ranks' group.
        Safe twice; the engine's attachments call it when they are released."""
        try:
            self._take(None)
        finally:
            self._sync.close()

    def _take(self, step: Optional[int]) -> Optional[Decision]:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        sent_for, votes, work = pending
        work.wait()
        if sent_for != step:
            return None
        scheduled, forced, finding, latest, earliest, loss = votes.tolist()
        given = _NO_LOSS < latest < _PENDING  # every rank with losses sent one
        agreed = (latest, _from_orderable(loss)) if given and latest == -earliest else None
        losses = dict(loss=agreed, losses_from=latest if given and agreed is None else None)
        if -finding == _NO_FINDING:
            return Decision(bool(scheduled or forced), forced=bool(forced), **losses)
        return Decision(True, -finding // 2, -finding % 2 == 0, forced=True, **losses)
