"""Statistics of a tensor spread over ranks (a DTensor's or FSDP's shards), combined exactly.

Each rank reduces its local shard (:func:`shard_statistics`); the partial sums, extremes and
counts are all-reduced, then every rank buckets a strided sample of its shard on the shared
grid (:func:`combine_shards`): every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from layerwatch.stats.batched import reduce_generic, as_real_values, prime_stride
from layerwatch.stats.rows import CENTERED_SUMSQ, COUNT, HIST, MAX, MIN, NONFINITE, SCALE, SUM, SUMSQ, ZEROS, row_width


def reduce_sharded(local_shards: Sequence[torch.Tensor], group: Any, bins: int, *, zeros: bool = False,
                   centered: bool = False, histogram_values: Optional[int] = None) -> torch.Tensor:
    """Exact rows of whole tensors whose shards live on the ranks of ``group``.

    Every rank of the group calls this with its own shards of the same tensors, in the
    same order, and gets the same rows (:func:`combine_shards`). ``histogram_values`` caps the
    values of each shard its bucket counts read (a strided sample, as :func:`reduce` takes).
    """
    if not local_shards:
        return torch.empty(0, row_width(bins), dtype=torch.float64)
    device = local_shards[0].device
    try:
        flat = [as_real_values(t) for t in local_shards]
        heads = torch.stack([shard_statistics(t, zeros, centered) for t in flat])
        samples = [t if histogram_values is None else t[:: prime_stride(t.numel(), histogram_values)] for t in flat]
    except Exception:  # this rank cannot measure its shards: it still takes part, and says so
        heads, samples = None, []
    return combine_shards(heads, samples, len(local_shards), group, bins, device)


def shard_statistics(flat: torch.Tensor, zeros: bool, centered: bool = False) -> torch.Tensor:
    """The first ``HIST`` columns of the row of ``flat`` (no grid), with masked ops: exact for
    any values, nothing read on the host. What :func:`combine_shards` adds up."""
    with torch.no_grad():
        return reduce_generic(flat, 0, zeros, centered)[:HIST]


def combine_shards(heads: Optional[torch.Tensor], samples: Sequence[torch.Tensor], n: int, group: Any, bins: int,
                   device: torch.device) -> torch.Tensor:
    """The rows of ``n`` whole tensors from each rank's rows of its shards, by every rank of
    ``group`` together; nothing is gathered.

    ``heads`` holds this rank's exact statistics of each shard (:func:`shard_statistics`), and
    ``samples[i]`` the values its bucket counts are drawn from (the shard itself, or a sample of
    it, scaled to its finite count). One ``all_reduce(MIN)`` of the shards' finite extremes
    fixes a shared histogram grid, then one ``all_reduce(SUM)`` adds up counts, sums, sums of
    squares, bucket counts and, when the heads hold them, the shards' centred sums of squares
    and ``sum**2 / count``: the whole tensor's centred sum of squares is theirs combined
    (Chan et al.), exact where ``SUMSQ - SUM**2 / COUNT`` loses every digit of a small spread.

    A rank that could not measure its shards passes ``heads=None``, and one whose work between
    the two collectives fails goes on with placeholders: either way it issues both, so no rank
    waits for it, and every rank's rows then read NaN in ``COUNT`` (see :attr:`Rows.failed`).
    ``group=None``: this rank's shards alone (no collective).
    """
    width = row_width(bins)
    failed = heads is None
    with torch.no_grad():
        try:
            extremes = torch.cat([heads[:, MIN], -heads[:, MAX]])
        except Exception:
            failed, extremes = True, torch.zeros(2 * n, dtype=torch.float64, device=device)
        _all_reduce(extremes, "MIN", group)
        additive = [COUNT, NONFINITE, SUM, SUMSQ, ZEROS, CENTERED_SUMSQ] + list(range(HIST, width))
        try:
            rows = torch.zeros(n, width, dtype=torch.float64, device=device)
            rows[:, :HIST] = heads
            rows[:, MIN], rows[:, MAX] = extremes[:n], -extremes[n:]
            for i, values in enumerate(samples if bins else []):
                row = reduce_generic(values, bins, False, False, (rows[i, MIN].to(values.dtype), rows[i, MAX].to(values.dtype)))
                rows[i, SCALE:] = row[SCALE:]
                rows[i, HIST:] *= heads[i, COUNT] / row[COUNT].clamp(min=1)  # a sample stands for every value
            between = heads[:, SUM] ** 2 / heads[:, COUNT].clamp(min=1)
            summed = torch.cat([rows[:, additive].reshape(-1), between, between.new_full((1,), float(failed))])
        except Exception:
            rows = torch.zeros(n, width, dtype=torch.float64, device=device)
            summed = torch.zeros(n * (len(additive) + 1) + 1, dtype=torch.float64, device=device)
            summed[-1] = 1.0
        _all_reduce(summed, "SUM", group)
        rows[:, additive] = summed[: n * len(additive)].view(n, len(additive))
        between = summed[n * len(additive) : -1]
        count = rows[:, COUNT].clamp(min=1)
        rows[:, CENTERED_SUMSQ] += between - rows[:, SUM] ** 2 / count  # NaN (not asked for) stays NaN
        rows[:, COUNT] = torch.where(summed[-1] > 0, torch.full_like(rows[:, COUNT], math.nan), rows[:, COUNT])
    return rows


def _all_reduce(tensor: torch.Tensor, op: str, group: Any) -> None:
    """``torch.distributed.all_reduce`` over ``group``; nothing for None (this rank alone)."""
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
