"""Norms of many tensors at once, one ``torch._foreach_norm`` per device and dtype: the NaN/Inf
checks of the sentinel, the probes' weights and the replay read them."""

from __future__ import annotations

from typing import Sequence

import torch


def device_dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices of ``tensors``, grouped by device and dtype (one fused norm each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def stacked_norms(tensors: list[torch.Tensor], ord: int = 2) -> torch.Tensor:
    """The ``ord``-norms of ``tensors`` of one device and dtype, accumulated in float32 at
    least, as one float32 tensor: one ``torch._foreach_norm``."""
    dtype = None if tensors[0].element_size() >= 4 or tensors[0].is_complex() else torch.float32
    with torch.no_grad():
        return torch.stack(torch._foreach_norm(tensors, ord, dtype=dtype)).float()


def fused_norms(tensors: Sequence[torch.Tensor], ord: int = 2) -> list[tuple[list[int], torch.Tensor]]:
    """The ``ord``-norms of ``tensors``, one ``torch._foreach_norm`` per device and dtype,
    accumulated in float32 at least: per group, the indices of its tensors and their norms
    (float32, on its device). A norm is NaN or Inf when a value is, and when finite values
    overflow float32: past ~1.8e19 for ``ord=2``, past ~3.4e38 (their sum) for ``ord=1``."""
    return [(indices, stacked_norms([tensors[i] for i in indices], ord)) for indices in device_dtype_groups(tensors)]


def nonfinite_names(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors that hold a NaN or Inf: one fused pass (:func:`fused_norms`),
    whose float32 sums also read as non-finite past ~1.8e19."""
    named = [(name, t.detach()) for name, t in named if t.numel() > 0]
    out = []
    for indices, norms in fused_norms([t for _, t in named]):
        out += [named[indices[i]][0] for i in (~torch.isfinite(norms)).nonzero().flatten().tolist()]
    return out
