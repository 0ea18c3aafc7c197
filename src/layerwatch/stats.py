"""Batched statistics and histograms of many tensors, computed where they live.

``reduce`` turns a list of tensors into one packed float64 tensor, a row per input
tensor, laid out by the column constants below. Statistics are over the *finite*
values; the count of NaN/Inf values is a column of its own, so a NaN never poisons a
histogram or a mean.

Histogram bins sit on a grid of width ``scale`` centred on multiples of ``scale``
around ``anchor`` (zero when the range spans zero, else the minimum): bin ``j`` in
``1..bins`` holds the values with ``round((x - anchor) / scale) + zp == j``. The grid
is chosen so the finite range ``[min, max]`` lands in bins ``1..bins``; bins ``0`` and
``bins + 1`` catch rounding spills at the ends. One grid definition serves both paths:

* the generic path: masked tensor ops that never read a value on the host, so a
  sampled step on a GPU makes no host sync until its single packed transfer;
* the CPU fast path: for tensors whose norm, min, max and sum are finite (checked, no
  device to sync with), 8-bit quantization plus ``bincount`` count the bins about 2.5x
  faster than ``torch.histc``.

With ``histogram_values=N``, the bucket counts of a tensor of more than N values are
estimated from an evenly strided sample of at most N of them plus its exact min and max,
scaled to the tensor's finite count; its statistics stay exact. The stride is a prime, so
it walks through every channel of a channels-first or channels-last layout alike.

Tensors of another floating dtype are measured in float32.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

# Columns of a packed row.
COUNT = 0  # finite values
NONFINITE = 1  # NaN or Inf values
MIN = 2
MAX = 3
SUM = 4
SUMSQ = 5
ZEROS = 6  # NaN unless zeros were asked for
CENTERED_SUMSQ = 7  # sum of (x - mean)^2; NaN unless asked for
SCALE = 8
ANCHOR = 9
ZERO_POINT = 10
HIST = 11  # then bins + 2 bucket counts: spill-low, 1..bins, spill-high

STATS = ("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")
MAX_BINS = 254  # bins + 1 must fit a uint8 quantization bucket

_HAS_QUANTIZE = hasattr(torch, "quantize_per_tensor")


def row_width(bins: int) -> int:
    return HIST + (bins + 2 if bins else 0)


@dataclass(frozen=True)
class Histogram:
    """A histogram as TensorBoard's ``HistogramProto`` holds it.

    ``bucket_limits[i]`` is the right edge of bucket ``i``; the left edge of the first
    bucket is ``min`` and the last limit equals ``max``.
    """

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[float]


def grid(mn: torch.Tensor, mx: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The histogram grid ``(scale, anchor, zero_point)`` for finite ranges ``[mn, mx]``."""
    span = mx - mn
    scale = torch.where(span > 0, span / (bins - 1), torch.ones_like(span))
    anchor = torch.where((mn <= 0) & (mx >= 0), torch.zeros_like(mn), mn)
    zero_point = 1 - torch.round((mn - anchor) / scale)
    return scale, anchor, zero_point


def reduce(
    tensors: Sequence[torch.Tensor],
    bins: int,
    *,
    zeros: bool = False,
    centered: bool = False,
    fast: bool = True,
    histogram_values: Optional[int] = None,
) -> torch.Tensor:
    """Pack statistics (and ``bins``-bucket histograms, 0 for none) of each tensor.

    All tensors must be on one device; the result is a ``(len(tensors), row_width(bins))``
    float64 tensor on that device. Nothing is read on the host unless the device is the
    CPU. ``fast=False`` forces the generic path (the reference the fast path is tested
    against). ``histogram_values`` caps the values a histogram reads (see the module's
    docstring); None reads them all.
    """
    if bins and not 2 <= bins <= MAX_BINS:
        raise ValueError(f"bins must be 0 or in [2, {MAX_BINS}], got {bins!r}")
    if histogram_values is not None and histogram_values < 1:
        raise ValueError(f"histogram_values must be None or a positive count, got {histogram_values!r}")
    if not tensors:
        return torch.empty(0, row_width(bins), dtype=torch.float64)
    flat = [as_real_values(t) for t in tensors]
    with torch.no_grad():
        if fast and flat[0].device.type == "cpu":
            return _reduce_cpu(flat, bins, zeros, centered, histogram_values)
        return torch.stack([_reduce_generic(t, bins, zeros, centered, histogram_values=histogram_values) for t in flat])


def as_real_values(t: torch.Tensor) -> torch.Tensor:
    """A flat float32 view (or copy) of ``t``'s values: a complex tensor counts its real and
    imaginary parts as values, so its norm is the norm of the complex tensor."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.float32 else flat.float()


def _reduce_generic(
    t: torch.Tensor,
    bins: int,
    zeros: bool,
    centered: bool,
    extremes: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    histogram_values: Optional[int] = None,
) -> torch.Tensor:
    """One tensor's row with masked ops only: correct for any values, no host read.

    ``extremes`` replaces the tensor's own finite (min, max), e.g. by a range shared by
    the shards of one tensor, so that their bucket counts add up.
    """
    finite = torch.isfinite(t)
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    x = torch.where(finite, t, zero)
    count = finite.sum()
    total = x.sum()
    mn, mx = _finite_extremes(t, finite) if extremes is None else extremes
    nan = torch.full((), math.nan, dtype=torch.float64, device=t.device)
    n_zeros = (t.numel() - torch.count_nonzero(t)) if zeros else nan
    if centered:
        dev = torch.where(finite, t - total / count.clamp(min=1), zero)
        csumsq = torch.dot(dev, dev)
    else:
        csumsq = nan
    head = [count, t.numel() - count, mn, mx, total, torch.dot(x, x), n_zeros, csumsq]
    if not bins:
        return torch.stack([v.to(torch.float64) for v in head])
    scale, anchor, zero_point = grid(mn, mx, bins)
    sample = _histogram_sample(t, histogram_values, torch.stack([mn, mx]))
    if sample is not t:
        finite = torch.isfinite(sample)
        x = torch.where(finite, sample, zero)
    q = torch.round((x - anchor) / scale) + zero_point
    q = torch.where(finite, q.clamp(0, bins + 1), torch.full_like(q, bins + 2)).long()
    counts = torch.zeros(bins + 3, dtype=torch.int64, device=t.device).scatter_add_(0, q, torch.ones_like(q))
    counts = counts[: bins + 2].to(torch.float64)
    if sample is not t:
        counts *= count / finite.sum().clamp(min=1)
    head += [scale, anchor, zero_point]
    return torch.cat([torch.stack([v.to(torch.float64) for v in head]), counts])


def _histogram_sample(t: torch.Tensor, limit: Optional[int], extremes: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it has at most ``limit`` values (or no limit), else every p-th value,
    p the smallest prime that keeps at most ``limit`` of them, followed by ``extremes``."""
    if limit is None or t.numel() <= limit:
        return t
    stride = _next_prime(-(-t.numel() // limit))
    return torch.cat([t[::stride], extremes.to(t.dtype)])


def _next_prime(n: int) -> int:
    n = max(n, 2)
    while any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def _finite_extremes(t: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of the finite values; (inf, -inf) when there are none (or no values)."""
    inf = torch.full((), math.inf, dtype=t.dtype, device=t.device)
    if t.numel() == 0:
        return inf, -inf
    return torch.where(finite, t, inf).amin(), torch.where(finite, t, -inf).amax()


def reduce_sharded(local_shards: Sequence[torch.Tensor], group: Any, bins: int, *, zeros: bool = False) -> torch.Tensor:
    """Exact rows of whole tensors whose shards live on the ranks of ``group``.

    Every rank of the group calls this with its own shards of the same tensors, in the
    same order, and gets the same rows. Nothing is gathered: one ``all_reduce(MIN)`` of
    the shards' finite extremes fixes a shared histogram grid, then one ``all_reduce(SUM)``
    adds up counts, sums, sums of squares and bucket counts. The std of a sharded tensor
    comes from its sum and sum of squares.
    """
    import torch.distributed as dist

    if not local_shards:
        return torch.empty(0, row_width(bins), dtype=torch.float64)
    flat = [as_real_values(t) for t in local_shards]
    with torch.no_grad():
        extremes = torch.stack([torch.stack(_finite_extremes(t, torch.isfinite(t))) for t in flat]).double()
        extremes[:, 1].neg_()
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=group)
        extremes[:, 1].neg_()
        rows = torch.stack(
            [
                _reduce_generic(t, bins, zeros, False, (extremes[i, 0].to(t.dtype), extremes[i, 1].to(t.dtype)))
                for i, t in enumerate(flat)
            ]
        )
        additive = [COUNT, NONFINITE, SUM, SUMSQ, ZEROS] + list(range(HIST, rows.shape[1]))
        summed = rows[:, additive].contiguous()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        rows[:, additive] = summed
        rows[:, CENTERED_SUMSQ] = rows[:, SUMSQ] - rows[:, SUM] ** 2 / rows[:, COUNT].clamp(min=1)
    return rows


def _reduce_cpu(
    flat: list[torch.Tensor], bins: int, zeros: bool, centered: bool, histogram_values: Optional[int]
) -> torch.Tensor:
    """The CPU fast path. Each tensor's passes run back to back while it is still in cache;
    on the CPU, reading a value on the host is not a device sync."""
    heads: list[list[float]] = []
    counts: list[torch.Tensor] = []
    generic: dict[int, torch.Tensor] = {}
    nan = math.nan
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*deprecated")
        for i, t in enumerate(flat):
            mn, mx = torch.aminmax(t)
            parts = [mn, mx, t.sum(), torch.linalg.vector_norm(t)]
            if zeros:
                parts.append(torch.count_nonzero(t))
            if centered:
                parts.append(torch.var(t, correction=0))
            values = torch.stack([p.double() for p in parts]).tolist()
            mn, mx, total, norm = values[:4]
            if not math.isfinite(mn + mx + total + norm):
                generic[i] = _reduce_generic(t, bins, zeros, centered, histogram_values=histogram_values)
                heads.append([nan] * HIST)  # replaced by row i of ``generic`` below
                if bins:
                    counts.append(torch.zeros(256, dtype=torch.float64))
                continue
            n = t.numel()
            extra = values[4:]
            n_zeros = n - extra.pop(0) if zeros else nan
            csumsq = extra.pop(0) * n if centered else nan
            head = [n, 0, mn, mx, total, norm * norm, n_zeros, csumsq]
            if bins:
                scale, anchor, zero_point = _grid_host(mn, mx, bins)
                head += [scale, anchor, zero_point]
                sample = _histogram_sample(t, histogram_values, torch.tensor([mn, mx]))
                bucket_counts = _bucket_counts_cpu(sample, bins, scale, anchor, zero_point).to(torch.float64)
                counts.append(bucket_counts if sample is t else bucket_counts * (n / sample.numel()))
            heads.append(head + [0.0] * (HIST - len(head)))
    out = torch.tensor(heads, dtype=torch.float64)
    if bins:
        hist = torch.stack(counts)
        hist[:, bins + 1] += hist[:, bins + 2 :].sum(dim=1)  # quantization spills past the top bucket
        out = torch.cat([out, hist[:, : bins + 2]], dim=1)
    for i, row in generic.items():
        out[i] = row
    return out


def _grid_host(mn: float, mx: float, bins: int) -> tuple[float, float, float]:
    """``grid`` for one finite range, in Python floats (same rounding: half to even)."""
    span = mx - mn
    scale = span / (bins - 1) if span > 0 else 1.0
    anchor = 0.0 if mn <= 0 <= mx else mn
    return scale, anchor, 1.0 - round((mn - anchor) / scale)


def _bucket_counts_cpu(t: torch.Tensor, bins: int, scale: float, anchor: float, zero_point: float) -> torch.Tensor:
    """256 bucket counts on the shared grid for a finite CPU tensor, by uint8 quantization."""
    if _HAS_QUANTIZE and 1 / scale < 3.0e38:
        try:
            shifted = t if anchor == 0 else t - anchor
            q = torch.quantize_per_tensor(shifted, scale, int(zero_point), torch.quint8).int_repr()
            return torch.bincount(q, minlength=256)
        except RuntimeError:
            pass
    counts = _reduce_generic(t, bins, False, False)[HIST:].to(torch.int64)
    return torch.cat([counts, counts.new_zeros(256 - len(counts))])


def histogram(row: np.ndarray, bins: int) -> Histogram | None:
    """The TensorBoard histogram of one packed row, or None when it has no finite value."""
    n = row[COUNT]
    if n == 0:
        return None
    mn, mx = float(row[MIN]), float(row[MAX])
    if mn == mx:
        return Histogram(mn, mx, n, float(row[SUM]), float(row[SUMSQ]), [mx], [float(n)])
    counts = row[HIST + 1 : HIST + bins + 1].copy()
    counts[0] += row[HIST]
    counts[-1] += row[HIST + bins + 1]
    limits = row[ANCHOR] + (np.arange(1, bins + 1) - row[ZERO_POINT] + 0.5) * row[SCALE]
    filled = np.flatnonzero(counts)
    lo, hi = filled[0], filled[-1] + 1
    limits = limits[lo:hi]
    limits[-1] = mx
    return Histogram(mn, mx, n, float(row[SUM]), float(row[SUMSQ]), limits.tolist(), counts[lo:hi].tolist())


def scalar_stats(rows: np.ndarray, stats: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-row values of the named statistics (see ``STATS``), over the finite values."""
    n = rows[:, COUNT]
    with np.errstate(divide="ignore", invalid="ignore"):
        derived = {
            "mean": lambda: rows[:, SUM] / n,
            "std": lambda: np.sqrt(np.maximum(rows[:, CENTERED_SUMSQ], 0) / n),
            "min": lambda: rows[:, MIN],
            "max": lambda: rows[:, MAX],
            "norm": lambda: np.sqrt(rows[:, SUMSQ]),
            "zero_frac": lambda: rows[:, ZEROS] / (n + rows[:, NONFINITE]),
            "nonfinite": lambda: rows[:, NONFINITE],
        }
        return {name: derived[name]() for name in stats}


def to_host(pieces: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Bring float64 device tensors to the host in one transfer per device, in order."""
    by_device: dict[torch.device, list[int]] = {}
    for i, piece in enumerate(pieces):
        by_device.setdefault(piece.device, []).append(i)
    out: list[np.ndarray] = [np.empty(0)] * len(pieces)
    for indices in by_device.values():
        flat = torch.cat([pieces[i].reshape(-1).to(torch.float64) for i in indices]).cpu().numpy()
        for i, part in zip(indices, np.split(flat, np.cumsum([pieces[i].numel() for i in indices])[:-1])):
            out[i] = part
    return out
