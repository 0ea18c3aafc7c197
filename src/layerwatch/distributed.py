"""Which rank does what, and sharded tensors (DTensor, FSDP2) without gathering them."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Union

import torch

NamedTensors = Sequence[tuple[str, torch.Tensor]]
Group = tuple[Any, list[str], list[torch.Tensor]]  # (process group or None, names, local tensors)


def is_writer_rank() -> bool:
    """Rank 0 writes; every rank takes part in the reductions of sharded tensors."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@functools.cache
def _dtensor_type() -> Union[type, tuple[()]]:
    """DTensor's class, or ``()`` on a torch without distributed (``isinstance(x, ())`` is False)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ()
    return DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, _dtensor_type()) else tensor


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local` of each tensor, without a Python call per tensor."""
    dtensor = _dtensor_type()
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


def this_ranks_groups(pairs: NamedTensors, warn_once: Callable[[str, str], None]) -> list[Group]:
    """``(group, names, tensors)`` this rank reduces: sharded tensors (local shards) with their
    process group on every rank, then the rest by device (group None) on rank 0.

    A DTensor sharded along one mesh dimension is reduced over that dimension's process
    group; replicated DTensors count as plain (their local tensor is the whole tensor).
    """
    plain: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    sharded: dict[Any, tuple[list[str], list[torch.Tensor]]] = {}
    writer = is_writer_rank()
    dtensor = _dtensor_type()
    for name, tensor in pairs:
        if isinstance(tensor, dtensor):
            shard_dims = [i for i, placement in enumerate(tensor.placements) if placement.is_shard()]
            if len(shard_dims) > 1:
                warn_once(f"shard:{name}", f"layerwatch: {name!r} is sharded along several mesh dimensions; not measured")
                continue
            if shard_dims:
                names, shards = sharded.setdefault(tensor.device_mesh.get_group(shard_dims[0]), ([], []))
                names.append(name)
                shards.append(tensor.to_local())
                continue
            tensor = tensor.to_local()
        if writer:
            names, tensors = plain.setdefault(tensor.device, ([], []))
            names.append(name)
            tensors.append(tensor)
    groups = [(group, names, shards) for group, (names, shards) in sharded.items()]
    return groups + [(None, names, tensors) for names, tensors in plain.values()]


def norms(tensors: list[torch.Tensor], group: Any = None) -> torch.Tensor:
    """L2 norms (float64); of whole sharded tensors when ``group`` holds their shards."""
    result = torch.stack(torch._foreach_norm(tensors)).to(torch.float64)  # stack promotes mixed dtypes
    if group is None:
        return result
    import torch.distributed as dist

    squares = result**2
    dist.all_reduce(squares, group=group)
    return squares.sqrt()
