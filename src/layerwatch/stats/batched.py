"""Batched statistics and histograms of many tensors, computed where they live.

``reduce`` turns a list of tensors into one packed float64 tensor, a row per input
tensor, laid out by the column constants below. Statistics are over the *finite*
values; the count of NaN/Inf values is a column of its own, so a NaN never poisons a
histogram or a mean.

Histogram bins sit on a grid of width ``scale`` centred on multiples of ``scale``
around ``anchor`` (zero when the range spans zero, else the minimum): bin ``j`` in
``1..bins`` holds the values with ``round((x - anchor) / scale) + zp == j``. The grid
is chosen so the finite range ``[min, max]`` lands in bins ``1..bins``; bins ``0`` and
``bins + 1`` catch rounding spills at the ends. ``round`` is half up, ``floor(v + 0.5)``: the
batched path folds the ``0.5`` into ``zero_point`` and truncates (values are clamped
non-negative first), one op fewer than round-half-even per value.

The work does not grow with the number of tensors: they are packed into chunks, each a
``(rows, width)`` matrix of whole tensors padded to whole rows (a large tensor is reduced
alone and whole, its values uncopied when it is contiguous float32), through buffers a
:class:`Workspace` keeps with a plan per set of shapes (:class:`_Plan`: one copy op fills a
chunk). Per chunk, a handful of ops write its rows' minima, maxima, sums and norms into
buffers of the whole call and copy its histogram sample aside. Per wave of chunks whose samples
fill a chunk's budget: each tensor's range and grid, and one bucket count (``bincount`` with a
per-tensor offset) over the samples. The rows are combined per tensor once for the whole call.
On an accelerator every op is masked (correct for any value) and
nothing is read on the host, so a sampled step makes no host sync until its single packed
transfer; on the CPU the unmasked ops run first and a chunk whose sum is not finite is done
again masked. ``fast=False`` reduces one tensor at a time with the masked ops: the
reference the batched path is tested against.

With ``histogram_values=N``, the bucket counts of a tensor of more than N values are
estimated from an evenly strided sample of at most N of them plus its exact min and max,
scaled to the tensor's finite count; its statistics stay exact. The stride is a prime, so
it walks through every channel of a channels-first or channels-last layout alike.

Tensors of another floating dtype are measured in float32.
"""


from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch

from layerwatch.stats.host import host_reads_free
from layerwatch.stats.rows import HIST, MAX, MAX_BINS, MIN, row_width


def grid(mn: torch.Tensor, mx: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The histogram grid ``(scale, anchor, zero_point)`` for finite ranges ``[mn, mx]``. A
    range too narrow for float32 (subnormal values, as a vanishing gradient has: its buckets'
    width would round to zero, where the values are bucketed) takes the smallest normal width:
    its values then share one bucket or two."""
    span = mx - mn
    scale = torch.where(span > 0, (span / (bins - 1)).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(span))
    anchor = torch.where((mn <= 0) & (mx >= 0), torch.zeros_like(mn), mn)
    zero_point = 1 - torch.floor((mn - anchor) / scale + 0.5)
    return scale, anchor, zero_point


def reduce(
    tensors: Sequence[torch.Tensor],
    bins: int,
    *,
    zeros: bool = False,
    centered: bool = False,
    fast: bool = True,
    histogram_values: Optional[int] = None,
    workspace: Optional["Workspace"] = None,
) -> torch.Tensor:
    """Pack statistics (and ``bins``-bucket histograms, 0 for none) of each tensor.

    All tensors must be on one device; the result is a ``(len(tensors), row_width(bins))``
    float64 tensor on that device. Nothing is read on the host unless the device is the
    CPU. ``fast=False`` reduces one tensor at a time with masked ops (the reference the
    batched path is tested against). ``histogram_values`` caps the values a histogram
    reads (see the module's docstring); None reads them all. ``workspace`` keeps the
    scratch buffers for the next call.
    """
    if bins and not 2 <= bins <= MAX_BINS:
        raise ValueError(f"bins must be 0 or in [2, {MAX_BINS}], got {bins!r}")
    if histogram_values is not None and histogram_values < 1:
        raise ValueError(f"histogram_values must be None or a positive count, got {histogram_values!r}")
    if not tensors:
        return torch.empty(0, row_width(bins), dtype=torch.float64)
    with torch.no_grad():
        if not fast:
            flat = [as_real_values(t) for t in tensors]
            return torch.stack([reduce_generic(t, bins, zeros, centered, histogram_values=histogram_values) for t in flat])
        if any([t.is_complex() for t in tensors]):  # a list: no Python frame per tensor
            tensors = [torch.view_as_real(t.resolve_conj()) if t.is_complex() else t for t in tensors]
        present = [i for i, t in enumerate(tensors) if t.numel()]
        if len(present) == len(tensors):
            return _Batch(tensors, bins, zeros, centered, histogram_values, workspace or Workspace()).rows()
        rows = torch.zeros(len(tensors), row_width(bins), dtype=torch.float64, device=tensors[0].device)
        rows[:, MIN], rows[:, MAX] = math.inf, -math.inf  # an empty tensor: no value, no histogram
        if present:
            batch = _Batch([tensors[i] for i in present], bins, zeros, centered, histogram_values, workspace or Workspace())
            rows.index_copy_(0, to_device(present, torch.int64, rows.device), batch.rows())
        return rows


def as_real_values(t: torch.Tensor) -> torch.Tensor:
    """A flat float32 view (or copy) of ``t``'s values: a complex tensor counts its real and
    imaginary parts as values, so its norm is the norm of the complex tensor."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.float32 else flat.float()


def reduce_generic(
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
    if not bins:  # the batched path's width: the grid's columns NaN
        return torch.stack([v.to(torch.float64) for v in head + [nan] * (HIST - len(head))])
    scale, anchor, zero_point = grid(mn, mx, bins)
    sample = _histogram_sample(t, histogram_values, torch.stack([mn, mx]))
    if sample is not t:
        finite = torch.isfinite(sample)
        x = torch.where(finite, sample, zero)
    q = torch.floor((x - anchor) / scale + 0.5) + zero_point
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


def prime_stride(n: int, limit: int) -> int:
    """The stride of an even sample of at most ``limit`` of ``n`` values: the smallest prime
    that keeps that few (a prime walks through every channel of any layout)."""
    return 1 if n <= limit else _next_prime(-(-n // limit))


@functools.lru_cache(maxsize=256)
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


class Workspace:
    """Scratch buffers kept from one call of :func:`reduce` to the next.

    Fresh memory costs a page fault per 4 KiB on the CPU (about 1 ms per MiB here), so the
    chunk buffers are allocated once; they hold a chunk's budget of values (``chunk_values``),
    more when one chunk needs more (a tensor padded to whole rows of a wide sample stride, or
    the histogram sample of a large tensor read whole: ``histogram_values=None``).
    """

    PLANS = 16  # the plans of the calls with different shapes seen last (gradients, weights, outputs...)

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype, str], torch.Tensor] = {}
        self._plans: dict[tuple, _Plan] = {}  # oldest first

    def plan(self, shapes: tuple[torch.Size, ...], device: torch.device, bins: int, limit: Optional[int]) -> "_Plan":
        """The :class:`_Plan` of a call on tensors of these shapes, made the first time."""
        key = (shapes, device, bins, limit if bins else None)  # the waves' bucket offsets depend on bins
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = _Plan(shapes, device, bins, limit)
            if len(self._plans) >= self.PLANS:
                del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    def get(self, device: torch.device, dtype: torch.dtype, n: int, slot: str, exact: bool = False) -> torch.Tensor:
        """``n`` values of ``slot``; a new buffer holds at least a chunk on the CPU, unless ``exact``."""
        key = (device, dtype, slot)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < n:
            size = n if exact or device.type != "cpu" else max(n, chunk_values(device))
            buffer = torch.empty(size, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:n]

    def drop(self, prefix: str, keep_cpu: bool = False) -> None:
        """Free the buffers whose slot starts with ``prefix`` (but the CPU's, with ``keep_cpu``)."""
        for key in [key for key in self._buffers if key[2].startswith(prefix)]:
            if not (keep_cpu and key[0].type == "cpu"):
                del self._buffers[key]

    def clear(self) -> None:
        self._buffers.clear()
        self._plans.clear()


ROW = 256  # values per row of a chunk, times the histogram stride: each row samples ROW values


def chunk_values(device: torch.device) -> int:
    """Values reduced by one set of ops: a chunk that stays in the CPU's last-level cache, more
    on an accelerator (fewer launches)."""
    return 1 << 20 if device.type == "cpu" else 1 << 22


class _Chunk(NamedTuple):
    """One chunk of a :class:`_Plan`: tensors ``first..last-1`` (one stride) in rows of
    ``width``, or (``single``) one large tensor reduced whole as one row (its values uncopied
    when it is contiguous float32; its histogram sample is copied). Where its results go:
    ``rows`` among the batch's rows, ``tails`` among the tensors of chunks (each one's last row,
    padded or not), ``samples`` in its wave's sample buffer. The index tensors are on the device."""

    first: int
    last: int
    width: int
    single: bool
    values: int  # values in the chunk, padding included
    pieces: list[int]  # each tensor's values, then its padding: how the chunk buffer is split
    rows: slice
    tails: slice
    samples: slice  # placed by _Plan._waves
    last_rows: Optional[torch.Tensor]  # per tensor, its last row in the chunk
    padding: Optional[tuple[torch.Tensor, torch.Tensor]]  # (mask of own values in the last rows, index of the last own one); None: none padded


class _Wave(NamedTuple):
    """Consecutive chunks whose histogram samples are counted together, once their rows are reduced."""

    chunks: range
    rows: slice
    samples: int  # values of the sample buffer used, whole ROW-wide rows
    owner: torch.Tensor  # per sample row, its tensor
    offsets: torch.Tensor  # per sample row, where its tensor's bucket counts start: (rows, 1)
    direct: bool  # one chunk of tensors read whole (stride 1): its matrix is its sample, not copied


class _Plan:
    """Everything of a batched call that depends only on its tensors' shapes, kept in the
    :class:`Workspace` for the next call with the same shapes: the order by histogram stride,
    the chunks and waves with their index tensors, and the views into the chunk buffer that
    each tensor is copied into (one ``_foreach_copy_`` per chunk). So a sampled step does no
    Python work per tensor beyond listing them."""

    def __init__(self, shapes: tuple[torch.Size, ...], device: torch.device, bins: int, limit: Optional[int]) -> None:
        by_stride: dict[int, list[int]] = {}
        for i, shape in enumerate(shapes):
            stride = 1 if not bins or limit is None else prime_stride(math.prod(shape), limit)
            by_stride.setdefault(stride, []).append(i)
        self.order = [i for indices in by_stride.values() for i in indices]  # grouped by stride
        self.shapes = [shapes[i] for i in self.order]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.strides = [s for s, indices in by_stride.items() for _ in indices]
        self.device = device
        inverse = [0] * len(shapes)
        for position, i in enumerate(self.order):
            inverse[i] = position
        # where each caller's tensor sits in the plan's order; None: the same order
        self.inverse = None if inverse == list(range(len(shapes))) else to_device(inverse, torch.int64, device)
        self._lay_out(bins)
        self.sizes_f64 = to_device(self.sizes, torch.float64, device)
        strided = [s > 1 for s in self.strides]
        self.strided = to_device(strided, torch.bool, device) if any(strided) else None  # sampled histograms
        self._views: dict[int, tuple[int, list[torch.Tensor]]] = {}  # chunk -> (buffer address, views)

    def _bounds(self):
        budget = chunk_values(self.device)
        first = 0
        while first < len(self.sizes):
            stride = self.strides[first]
            width = ROW * stride
            if self.sizes[first] >= budget // 2:
                yield first, first + 1, 0, True
                first += 1
                continue
            last, size = first, 0
            while last < len(self.sizes) and self.strides[last] == stride:
                n = -(-self.sizes[last] // width) * width
                if last > first and size + n > budget:
                    break
                size += n
                last += 1
            yield first, last, width, False
            first = last

    def _lay_out(self, bins: int) -> None:
        """The chunks, the rows (each one tensor's) and their owners, each tensor's padding and
        its sampled padding, and the waves."""
        device, sizes = self.device, self.sizes
        chunks, row_owner, row_counts, sample_rows, sample_sizes = [], [], [], [], []
        tail_rows, tail_pads = [], []
        sampled_pads = [0] * len(sizes)  # per tensor, the padding values its sample holds
        unplaced = slice(0, 0)
        for first, last, width, single in self._bounds():
            row, tail = len(row_owner), len(tail_rows)
            if single:
                sample = -(-sizes[first] // self.strides[first]) if bins else 0
                sampled_pads[first] = -sample % ROW
                row_owner.append(first)
                row_counts.append(sizes[first])
                chunks.append(_Chunk(first, last, 0, True, sizes[first], [], slice(row, row + 1), slice(tail, tail),
                                     unplaced, None, None))
                sample_rows.append([first] * (-(-sample // ROW)))
                sample_sizes.append(sample + sampled_pads[first])
                continue
            stride = self.strides[first]
            pads = [-n % width for n in sizes[first:last]]
            pieces, last_rows = [], []
            for i, pad in zip(range(first, last), pads):
                rows = (sizes[i] + pad) // width
                row_owner += [i] * rows
                row_counts += [width] * (rows - 1) + [width - pad]
                last_rows.append(len(row_owner) - 1 - row)
                tail_rows.append(len(row_owner) - 1)
                sampled_pads[i] = (width - 1) // stride - (width - pad - 1) // stride
                pieces += [sizes[i], pad]
            chunk_rows = len(row_owner) - row
            padding = None
            if any(pads):
                real = torch.tensor([width - pad for pad in pads])
                padding = (to_device(torch.arange(width) < real[:, None], torch.bool, device),
                           to_device((real - 1)[:, None], torch.int64, device))
            tail_pads += pads
            chunks.append(_Chunk(first, last, width, False, chunk_rows * width, pieces, slice(row, len(row_owner)),
                                 slice(tail, len(tail_rows)), unplaced, to_device(last_rows, torch.int64, device), padding))
            sample_rows.append(row_owner[row:] if bins else [])
            sample_sizes.append(chunk_rows * ROW if bins else 0)
        self.rows = len(row_owner)
        self.row_owner = to_device(row_owner, torch.int64, device)
        self.row_counts = to_device(row_counts, torch.float64, device)
        self.tail_rows = to_device(tail_rows, torch.int64, device)
        self.tail_pads = to_device(tail_pads, torch.float64, device)
        self.tail_tensors = self.row_owner[self.tail_rows]
        self.sampled_pads = to_device(sampled_pads, torch.float64, device)
        self.chunks, self.waves = self._waves(chunks, sample_sizes, sample_rows, bins)

    def _waves(self, chunks: list[_Chunk], sample_sizes: list[int], sample_rows: list[list[int]],
               bins: int) -> tuple[list[_Chunk], list[_Wave]]:
        """Consecutive chunks grouped while their samples (``sample_sizes`` values, in rows owned by
        ``sample_rows``) fit a chunk's budget, one chunk per wave at least; each chunk's sample
        placed in its wave's buffer."""
        budget, placed, waves, start = chunk_values(self.device), [], [], 0
        while start < len(chunks):
            end, used = start, 0
            while end < len(chunks) and (end == start or used + sample_sizes[end] <= budget):
                placed.append(chunks[end]._replace(samples=slice(used, used + sample_sizes[end])))
                used += sample_sizes[end]
                end += 1
            owner = [i for rows in sample_rows[start:end] for i in rows]
            owner_device = to_device(owner, torch.int64, self.device)
            # bincount reads int32 twice as fast on the CPU; scatter_add_ (an accelerator's) takes int64 only
            index_dtype = torch.int32 if self.device.type == "cpu" else torch.int64
            direct = end == start + 1 and not chunks[start].single and self.strides[chunks[start].first] == 1
            waves.append(_Wave(range(start, end), slice(chunks[start].rows.start, chunks[end - 1].rows.stop), used,
                               owner_device, (owner_device * (bins + 3)).to(index_dtype)[:, None], direct))
            start = end
        return placed, waves

    def fill(self, index: int, tensors: Sequence[torch.Tensor], workspace: "Workspace") -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``index`` of ``tensors`` (in the plan's order) copied into the workspace's chunk
        buffer, padded with each tensor's last value: a ``(rows, width)`` matrix, and its
        tensors' last rows."""
        chunk = self.chunks[index]
        # At least a chunk's budget at once, so that the buffer (and the views into it) rarely changes
        buffer = workspace.get(self.device, torch.float32, max(chunk.values, chunk_values(self.device)), "chunk")
        buffer = buffer[: chunk.values]
        address = buffer.data_ptr()
        cached = self._views.get(index)
        if cached is None or cached[0] != address:
            views = [piece if len(shape) == 1 else piece.view(shape)
                     for piece, shape in zip(buffer.split_with_sizes(chunk.pieces)[::2], self.shapes[chunk.first : chunk.last])]
            cached = self._views[index] = (address, views)
        torch._foreach_copy_(cached[1], tensors[chunk.first : chunk.last])
        x = buffer.view(-1, chunk.width)
        tails = x[chunk.last_rows]
        if chunk.padding is not None:
            own, last = chunk.padding
            tails = torch.where(own, tails, tails.gather(1, last))
            x[chunk.last_rows] = tails
        return x, tails


class _Partials:
    """Per row of a batch, what its chunk's ops give: min, max, and the float32 sum and norm
    with the padding counted; per tensor of a chunk, the float64 sum and norm of its last row
    less its last value (its padding is then exactly 0); each tensor's last value. The counts of
    finite values are the plan's until a chunk is masked."""

    def __init__(self, plan: _Plan, zeros: bool, centered: bool) -> None:
        rows, tails, device = plan.rows, len(plan.tail_pads), plan.device
        self.plan = plan
        f32 = torch.float32  # whatever the default dtype
        self.mn, self.mx, self.sum, self.norm = (torch.empty(rows, dtype=f32, device=device) for _ in range(4))
        self.tail_sum, self.tail_norm = (torch.empty(tails, dtype=torch.float64, device=device) for _ in range(2))
        self.last = torch.empty(len(plan.sizes), dtype=f32, device=device)
        self.count: Optional[torch.Tensor] = None  # None: every row's values are all finite
        self.zeros = torch.empty(rows, dtype=torch.float64, device=device) if zeros else None
        self.m2 = torch.empty(rows, dtype=torch.float64, device=device) if centered else None

    def finite_counts(self) -> torch.Tensor:
        """The counts to write a masked chunk's finite counts into."""
        if self.count is None:
            self.count = self.plan.row_counts.clone()
        return self.count

    def chunk(self, c: _Chunk, x: torch.Tensor, tails: torch.Tensor, masked: bool) -> None:
        """The rows of a chunk of tensors padded to whole rows."""
        rows, t = c.rows, c.tails
        last = tails[:, -1]
        self.last[c.first : c.last] = last
        if masked:
            finite = torch.isfinite(x)
            values = torch.where(finite, x, 0.0)
            torch.amin(torch.where(finite, x, math.inf), 1, out=self.mn[rows])
            torch.amax(torch.where(finite, x, -math.inf), 1, out=self.mx[rows])
            last_finite = torch.isfinite(last)
            counts = finite.sum(1).to(torch.float64)
            counts[c.last_rows] -= self.plan.tail_pads[t] * last_finite
            self.finite_counts()[rows] = counts
            shifted = torch.where(torch.isfinite(tails), tails.double() - _finite_or_zero(last)[:, None], 0.0)
        else:
            values = x
            torch.amin(x, 1, out=self.mn[rows])
            torch.amax(x, 1, out=self.mx[rows])
            shifted = tails.double() - last.double()[:, None]  # float64: a few rows, and no overflow near float32's limit
        torch.sum(values, 1, out=self.sum[rows])
        torch.linalg.vector_norm(values, dim=1, out=self.norm[rows])
        torch.sum(shifted, 1, out=self.tail_sum[t])
        torch.linalg.vector_norm(shifted, dim=1, out=self.tail_norm[t])
        if self.zeros is not None:
            self.zeros[rows] = x.shape[1] - torch.count_nonzero(x, dim=1)
        if self.m2 is not None:
            self._centered(c, x, tails, shifted, masked)

    def _centered(self, c: _Chunk, x: torch.Tensor, tails: torch.Tensor, shifted: torch.Tensor, masked: bool) -> None:
        """Per row, the sum of squared deviations of its own values from their mean."""
        f64, rows, t = torch.float64, c.rows, c.tails
        count = (self.plan.row_counts if self.count is None else self.count)[rows]
        tail_count = count[c.last_rows]
        total = _own_sums(self.sum[rows], self.tail_sum[t], tail_count, _finite_or_zero(self.last[c.first : c.last]), c.last_rows)
        dev = x - (total / count.clamp(min=1)).to(x.dtype)[:, None]
        if masked:
            dev = torch.where(torch.isfinite(x), dev, 0.0)
        m2 = torch.linalg.vector_norm(dev, dim=1).to(f64) ** 2
        tail_dev = shifted - (self.tail_sum[t] / tail_count.clamp(min=1))[:, None]
        own = None if c.padding is None else c.padding[0]
        if masked:
            own = torch.isfinite(tails) if own is None else own & torch.isfinite(tails)
        if own is not None:  # the padding is not a value
            tail_dev = torch.where(own, tail_dev, 0.0)
        m2[c.last_rows] = torch.linalg.vector_norm(tail_dev, dim=1).to(f64) ** 2
        self.m2[rows] = m2

    def single(self, c: _Chunk, t: torch.Tensor, masked: bool) -> None:
        """The one row of a large tensor, reduced whole."""
        r = c.rows.start
        self.last[c.first] = t[-1]
        if masked:
            finite = torch.isfinite(t)
            values = torch.where(finite, t, 0.0)
            torch.amin(torch.where(finite, t, math.inf), 0, out=self.mn[r])
            torch.amax(torch.where(finite, t, -math.inf), 0, out=self.mx[r])
            self.finite_counts()[r] = finite.sum()
        else:
            values = t
            torch.amin(t, 0, out=self.mn[r])
            torch.amax(t, 0, out=self.mx[r])
        torch.sum(values, 0, out=self.sum[r])
        torch.sqrt(torch.dot(values, values), out=self.norm[r])  # dot: faster than vector_norm on the CPU, and closer
        if self.zeros is not None:
            self.zeros[r] = t.numel() - torch.count_nonzero(t)
        if self.m2 is not None:
            if masked:
                dev = torch.where(finite, t - (self.sum[r] / self.count[r].clamp(min=1)).to(t.dtype), 0.0)
                self.m2[r] = torch.linalg.vector_norm(dev).to(torch.float64) ** 2
            else:  # one pass, no temporary of the tensor's size
                self.m2[r] = torch.var(t, correction=0).to(torch.float64) * t.numel()

    def totals(self) -> tuple[torch.Tensor, ...]:
        """Per row, over its own values (float64): count, sum, sum of squares, zeros (the count
        when not asked for), sum of squared deviations (the count when not asked for)."""
        plan, f64 = self.plan, torch.float64
        count = plan.row_counts if self.count is None else self.count
        v, tail_count = _finite_or_zero(self.last[plan.tail_tensors]), count[plan.tail_rows]
        total = _own_sums(self.sum, self.tail_sum, tail_count, v, plan.tail_rows)
        sumsq = self.norm.to(f64) ** 2
        sumsq[plan.tail_rows] = self.tail_norm ** 2 + 2 * v * self.tail_sum + tail_count * v * v
        zeros = count
        if self.zeros is not None:
            zeros = self.zeros.clone()
            zeros[plan.tail_rows] -= plan.tail_pads * (self.last[plan.tail_tensors] == 0)
        return count, total, sumsq, zeros, count if self.m2 is None else self.m2


def _finite_or_zero(last: torch.Tensor) -> torch.Tensor:
    """Last values as the padding's sums take them out (float64): 0 for a NaN or Inf, whose
    padding was never counted."""
    return torch.where(torch.isfinite(last), last, 0.0).to(torch.float64)


def _own_sums(sums: torch.Tensor, tail_sums: torch.Tensor, tail_counts: torch.Tensor, last: torch.Tensor,
              tail_rows: torch.Tensor) -> torch.Tensor:
    """Row sums (float64) over each row's own values: a tensor's last row is summed as its
    sum less its last value, plus that value times its own count (summing the padding in
    float32 and taking it out in float64 would cancel away a small tensor's digits)."""
    total = sums.to(torch.float64)
    total[tail_rows] = tail_sums + tail_counts * last
    return total


class _Batch:
    """All tensors of one call, reduced chunk by chunk (see the module's docstring).

    A chunk is a ``(rows, width)`` matrix of whole tensors, each padded to whole rows with
    copies of its own last value, or one large tensor. Per chunk, a few ops write its rows'
    partial results (:class:`_Partials`) and copy its histogram sample into its wave's buffer.
    Per wave: each tensor's range and grid, and one bucket count of the samples. Once for the
    batch: the rows combined per tensor, and the padding taken back out.
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], bins: int, zeros: bool, centered: bool, limit: Optional[int], workspace: Workspace
    ) -> None:
        self.bins, self.zeros, self.centered, self.workspace = bins, zeros, centered, workspace
        self.device = tensors[0].device
        self.plan = workspace.plan(tuple([t.shape for t in tensors]), self.device, bins, limit)
        self.tensors = tensors if self.plan.inverse is None else [tensors[i] for i in self.plan.order]

    def rows(self) -> torch.Tensor:
        n, bins, device, plan = len(self.tensors), self.bins, self.device, self.plan
        self.mn = torch.full((n,), math.inf, dtype=torch.float32, device=device)
        self.mx = torch.full((n,), -math.inf, dtype=torch.float32, device=device)
        self.counts = torch.zeros(n * (bins + 3), dtype=torch.int64, device=device) if bins else None
        partials = _Partials(plan, self.zeros, self.centered)
        for wave in plan.waves:
            copied = bins and not wave.direct
            sample = self.workspace.get(device, torch.float32, wave.samples, "sample") if copied else None
            wave_masked = False
            for index in wave.chunks:
                masked, matrix = self._chunk(index, partials, sample)
                wave_masked |= masked
            self.mn.scatter_reduce_(0, plan.row_owner[wave.rows], partials.mn[wave.rows], "amin")
            self.mx.scatter_reduce_(0, plan.row_owner[wave.rows], partials.mx[wave.rows], "amax")
            if bins:  # the wave's tensors now have their whole range, so their grid
                self.grid = grid(self.mn, self.mx, bins)
                self._count(wave, sample if copied else matrix, wave_masked)  # direct: one chunk, its matrix
        out = self._finish(partials)
        return out if plan.inverse is None else out.index_select(0, plan.inverse)

    def _chunk(self, index: int, partials: _Partials, sample: Optional[torch.Tensor]) -> tuple[bool, Optional[torch.Tensor]]:
        """Reduce chunk ``index`` into ``partials``, and copy its sample into ``sample`` (unless None);
        whether it was masked, and its matrix (None for a single tensor).

        On the CPU the unmasked ops run first, and a chunk whose sum is not finite is done
        again masked (the CPU reads the sum freely); an accelerator masks every chunk."""
        c = self.plan.chunks[index]
        masked = not host_reads_free(self.device)
        stride = self.plan.strides[c.first]
        if c.single:
            t = self.tensors[c.first].reshape(-1)
            t = t if t.dtype == torch.float32 else t.float()
            partials.single(c, t, masked)
            if not masked and not math.isfinite(float(partials.sum[c.rows.start])):
                masked = True
                partials.single(c, t, masked)
            if sample is not None:
                region, taken = sample[c.samples], t[::stride]
                region[: taken.numel()] = taken
                region[taken.numel() :] = t[-1]
            return masked, None
        x, tails = self.plan.fill(index, self.tensors, self.workspace)
        partials.chunk(c, x, tails, masked)
        if not masked and not math.isfinite(float(partials.sum[c.rows].sum())):
            masked = True
            partials.chunk(c, x, tails, masked)
        if sample is not None:
            sample[c.samples].view(-1, ROW).copy_(x[:, ::stride])
        return masked, x

    def _count(self, wave: _Wave, sample: torch.Tensor, masked: bool) -> None:
        """Bucket counts of one wave's samples, on the grid of each tensor's range (``self.grid``)."""
        bins = self.bins
        scale, anchor, zero_point = (g[wave.owner, None] for g in self.grid)
        sample = sample.view(-1, ROW)
        q = self.workspace.get(self.device, torch.float32, wave.samples, "bucket").view(sample.shape)
        torch.sub(sample, anchor, out=q)
        q.div_(scale).add_(zero_point + 0.5).clamp_(0, bins + 1)  # truncated below: rounded half up
        if masked:
            q = torch.where(torch.isfinite(sample), q, torch.full((), bins + 2.0, device=q.device))
        index = self.workspace.get(self.device, wave.offsets.dtype, wave.samples, "index").view(sample.shape)
        index.copy_(q)
        index.add_(wave.offsets)
        self.counts += bincount(index.view(-1), self.counts.numel())

    def _finish(self, rows: _Partials) -> torch.Tensor:
        """Per-tensor rows from the rows' own sums: sums combined, the sums of squared deviations
        by Chan et al.'s rule; the padding taken back out of the bucket counts."""
        n, device, f64, bins, plan = len(self.tensors), self.device, torch.float64, self.bins, self.plan
        per_row = rows.totals()
        sums = torch.zeros(n, len(per_row), dtype=f64, device=device).index_add_(0, plan.row_owner, torch.stack(per_row, 1))
        count, total = sums[:, 0], sums[:, 1]
        nan = torch.full((n,), math.nan, dtype=f64, device=device)
        csumsq = nan
        if self.centered:
            row_count, row_mean = per_row[0], per_row[1] / per_row[0].clamp(min=1)
            mean = total / count.clamp(min=1)
            spread = torch.zeros(n, dtype=f64, device=device).index_add_(0, plan.row_owner, row_count * (row_mean - mean[plan.row_owner]) ** 2)
            csumsq = (sums[:, 4] + spread).clamp(min=0)
        head = [count, plan.sizes_f64 - count, self.mn.to(f64), self.mx.to(f64), total, sums[:, 2], sums[:, 3] if self.zeros else nan, csumsq]
        if not bins:
            return torch.stack(head + [nan] * (HIST - len(head)), dim=1)
        scale, anchor, zero_point = self.grid
        counts = self.counts.view(n, bins + 3).to(f64)

        def bucket(values: torch.Tensor) -> torch.Tensor:
            return _bucket_of(values, scale, anchor, zero_point, bins)[:, None]

        counts.scatter_add_(1, bucket(rows.last), -plan.sampled_pads[:, None])
        counts = counts[:, : bins + 2]
        strided = plan.strided
        if strided is not None:  # a sample, with the exact extremes, stands for every finite value
            found = ((count > 0) & strided).to(f64)[:, None]
            for extreme in (self.mn, self.mx):
                counts.scatter_add_(1, bucket(extreme).clamp(max=bins + 1), found)
            scaled = counts * (count[:, None] / counts.sum(1, keepdim=True).clamp(min=1))
            counts = torch.where(strided[:, None], scaled, counts)
        head += [scale.to(f64), anchor.to(f64), zero_point.to(f64)]
        return torch.cat([torch.stack(head, dim=1), counts], dim=1)


def _bucket_of(v: torch.Tensor, scale: torch.Tensor, anchor: torch.Tensor, zero_point: torch.Tensor, bins: int) -> torch.Tensor:
    """The bucket each tensor's value ``v`` falls in on its grid (``bins + 2``: not finite), by
    the same float32 ops as a sample's bucket count, so a value lands where it was counted."""
    q = ((v - anchor) / scale + (zero_point + 0.5)).clamp(0, bins + 1).floor()
    return torch.where(torch.isfinite(v), q, torch.full_like(q, bins + 2)).long()


def to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small host values on ``device``; to an accelerator through pinned memory, without
    blocking (a pageable copy would wait for the device)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def bincount(index: torch.Tensor, size: int) -> torch.Tensor:
    """Counts of each value in ``[0, size)``; on an accelerator without a host sync."""
    if host_reads_free(index.device):
        return torch.bincount(index, minlength=size)
    return torch.zeros(size, dtype=torch.int64, device=index.device).scatter_add_(
        0, index, torch.ones((), dtype=torch.int64, device=index.device).expand_as(index)
    )
