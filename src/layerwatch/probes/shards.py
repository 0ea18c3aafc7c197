"""Tensor parallel in sight: which plain tensors the runtime probe sees are one rank's shard.

A tensor-parallel style's output hook may make a module's sharded DTensor output local, and
the modules after it compute on such local shards alone (the layers between a column-wise and
a row-wise parallel layer). Their values are spread over ranks although nothing in the tensor
says so: :class:`LocalShards` remembers the group each such tensor is a shard over, so that
its flag and row are combined with the other ranks' (see ``RuntimeProbe.result``).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from layerwatch.distributed.sharding import is_dtensor


class LocalShards:
    """The plain tensors of one sampled step that are one rank's shard of a whole."""

    def __init__(self) -> None:
        # Per module with a DTensor parameter: how its last output was spread before its own
        # output hook made it local, and that local shape
        self.raw: dict[int, tuple[Any, torch.Size]] = {}
        # id(tensor) -> (a weak reference, the group): a tensor-parallel module's output made
        # local, and what modules make of it until the next such module takes it back as a DTensor
        self.of: dict[int, tuple[Any, Any]] = {}

    def forget(self) -> None:
        self.raw, self.of = {}, {}

    def group_of(self, tensors: list[torch.Tensor]) -> Any:
        """The group the first of ``tensors`` known as a shard is a shard over, or None."""
        for t in tensors:
            entry = self.of.get(id(t))
            if entry is not None and entry[0]() is t:
                return entry[1]
        return None

    def output_group(self, index: int, in_group: Optional[Any], outputs: list[torch.Tensor]) -> Any:
        """The group over which the plain ``outputs`` of module ``index`` are one rank's shards
        of the whole, or None: where the module made its sharded DTensor output local (a
        tensor-parallel style's output hook), or where its inputs were such shards over
        ``in_group`` (it computed on them alone). Such outputs are remembered."""
        raw = self.raw.pop(index, None)
        if not outputs or any(is_dtensor(t) for t in outputs):
            return None
        if raw is not None:
            how, local_shape = raw
            if how is None or how.kind != "shard" or len(outputs) != 1 or outputs[0].shape != local_shape:
                return None
            group = how.group
        else:
            group = in_group
        if group is not None:
            for t in outputs:
                self.of[id(t)] = (weakref.ref(t), group)
        return group
