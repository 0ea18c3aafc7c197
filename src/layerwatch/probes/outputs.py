"""What the hooks keep of the tensors they see, on the device until the step is over: the
NaN/Inf evidence of each flagged tensor (:class:`FlagSlots`) and the values of each measured
output (:class:`Outputs`), reduced together after the step."""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch

from layerwatch import stats as S

# An output of up to this many values is copied in its hook and measured after the step with
# all the others (one batched reduction); a larger one gets its statistics from a few
# whole-tensor ops in the hook and its histogram from a strided sample of this many values.
HISTOGRAM_VALUES = S.HISTOGRAM_VALUES
STASH_VALUES = 1 << 22  # the buffer the copies of one step go to (16 MiB of float32, on any device)


class FlagSlots:
    """The NaN/Inf evidence of the tensors the hooks flag, one device value each, written into
    buffers kept from step to step: a tensor's sum, not finite exactly when the tensor holds
    a NaN or Inf (see :func:`nonfinite_sum`). A tensor
    object kept per flag would leave thousands of objects for the garbage collector to walk
    on every collection of the step."""

    SIZE = 1024

    def __init__(self, workspace: S.Workspace) -> None:
        self._workspace = workspace
        self._devices: list[torch.device] = []
        self._buffers: list[list[torch.Tensor]] = []  # per device
        self._used: list[int] = []  # per device
        self._device_of: list[int] = []  # per slot
        self._local: list[int] = []  # per slot: its position in its device's buffers
        self._sharded: dict[Any, list[int]] = {}  # process group -> the slots of tensors spread over its ranks

    @property
    def spread_counts(self) -> list[int]:
        """How many slots flag a tensor spread over ranks, per process group (in order)."""
        return [len(slots) for slots in self._sharded.values()]

    def add(self, value: torch.Tensor, group: Any = None) -> int:
        """A new slot holding the 0-d ``value`` (copied on its device, no host sync); with a
        ``group``, the flag of a tensor of which ``value`` read this rank's part only, to be
        combined with the other ranks' by :meth:`combine`."""
        device = value.device
        if device in self._devices:
            d = self._devices.index(device)
        else:
            d = len(self._devices)
            self._devices.append(device)
            self._buffers.append([])
            self._used.append(0)
        buffers, local = self._buffers[d], self._used[d]
        self._used[d] += 1
        if local == len(buffers) * self.SIZE:
            buffers.append(self._workspace.get(device, torch.float64, self.SIZE, f"flags{len(buffers)}", exact=True))
        buffers[local // self.SIZE][local % self.SIZE] = value
        self._device_of.append(d)
        self._local.append(local)
        if group is not None:
            self._sharded.setdefault(group, []).append(len(self._local) - 1)
        return len(self._local) - 1

    def combine(self) -> None:
        """Every rank of each group flags a spread tensor when any rank's part of it holds a
        NaN or Inf: one all_reduce per group, by every rank, in the order the groups came. A
        rank whose own part fails still takes part (then raises)."""
        import torch.distributed as dist

        error = None
        for group, slots in self._sharded.items():
            cells = [(self._buffers[self._device_of[slot]], self._local[slot]) for slot in slots]
            try:
                values = torch.stack([buffers[i // self.SIZE][i % self.SIZE] for buffers, i in cells])
                bad = values.isfinite().logical_not().to(torch.float64)
            except Exception as e:
                error, bad = error or e, torch.zeros(len(cells), dtype=torch.float64, device=self._devices[self._device_of[slots[0]]])
            dist.all_reduce(bad, op=dist.ReduceOp.SUM, group=group)
            if error is None:
                for (buffers, i), value in zip(cells, torch.where(bad > 0, math.nan, 0.0).unbind()):
                    buffers[i // self.SIZE][i % self.SIZE] = value
        if error is not None:
            raise error

    def pieces(self) -> list[torch.Tensor]:
        """The used values of each device, to bring to the host with other pieces."""
        return [torch.cat(buffers)[:n] for buffers, n in zip(self._buffers, self._used)]

    def flagged(self, host_pieces: Sequence[np.ndarray]) -> np.ndarray:
        """Per slot, from the host copies of :meth:`pieces`: whether its tensor held a NaN or Inf."""
        values = np.array([host_pieces[d][local] for d, local in zip(self._device_of, self._local)], dtype=np.float64)
        return ~np.isfinite(values)


class Outputs:
    """The statistics rows of the measured outputs of one step, all made after it.

    A hook does the least it can: an output of up to ``HISTOGRAM_VALUES`` values is copied
    (one op) into a stash kept from step to step; a larger one gets its count of finite
    values, min, max, sum and norm from a few whole-tensor ops (read at once on the CPU, where
    reading a value is no sync), and a strided sample, then those extremes, copied into the
    stash for its histogram. Either way its row's NONFINITE column flags it. After the step one batched
    :func:`~layerwatch.stats.reduce` measures the copies and the samples together.
    """

    def __init__(self, bins: int, zeros: bool, centered: bool, workspace: S.Workspace) -> None:
        self.bins, self.zeros, self.centered, self.workspace = bins, zeros, centered, workspace
        # Per row: where its values are in the stash, or -1 and the tensor in ``kept``
        # (ints, not one view per row: fewer objects alive for the garbage collector).
        self._offset: list[int] = []
        self._length: list[int] = []
        self.kept: dict[int, torch.Tensor] = {}  # row -> a clone or a sample
        self.exact: dict[int, tuple[torch.Tensor | np.ndarray, int]] = {}  # row -> (statistics from the hook, values)
        # row -> (process group, this rank's statistics of its part, a sample of that part):
        # an output spread over ranks, its row made with the other ranks' (see :meth:`add`)
        self.sharded: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._stash: Optional[torch.Tensor] = None  # where copies go: a buffer kept from step to step
        self._used = 0

    def _keep(self, flat: torch.Tensor, copy: bool, extremes: Optional[torch.Tensor] = None) -> int:
        """A new row for ``flat`` (then ``extremes``, when given): copied into the stash (freeing
        hundreds of small copies after every sample made the next step fault their pages back
        in), or kept (cloned when ``copy``) when it is full or on another device."""
        row, n = len(self._offset), flat.numel() + (0 if extremes is None else extremes.numel())
        if copy and self._stash is None:
            self._stash = self.workspace.get(flat.device, torch.float32, STASH_VALUES, "outputs")
        if copy and self._stash.device == flat.device and self._used + n <= self._stash.numel():
            self._stash[self._used : self._used + flat.numel()].copy_(flat)
            if extremes is not None:
                self._stash[self._used + flat.numel() : self._used + n].copy_(extremes)
            self._offset.append(self._used)
            self._used += n
        else:
            self.kept[row] = (flat.clone() if copy else flat) if extremes is None else torch.cat([flat, extremes.to(flat)])
            self._offset.append(-1)
        self._length.append(n)
        return row

    def add(self, t: torch.Tensor, group: Any = None) -> int:
        """Record ``t``; its row (whose NONFINITE column flags it). With a ``group``, ``t`` is
        this rank's shard of an output spread over the group's ranks: its exact statistics
        (masked ops, nothing read on the host) and a sample of its values for the histogram
        are kept, and after the step every rank's are combined into the whole output's row
        (:func:`~layerwatch.stats.combine_shards`)."""
        flat = S.as_real_values(t)
        n = flat.numel()
        if group is not None:
            row = len(self._offset)
            self.sharded[row] = (group, S.shard_statistics(flat, self.zeros, self.centered), flat[:: S.prime_stride(n, HISTOGRAM_VALUES)].clone())
            self._offset.append(-1)
            self._length.append(0)
            return row
        if n <= HISTOGRAM_VALUES:
            return self._keep(flat, copy=True)
        sample = flat[:: S.prime_stride(n, HISTOGRAM_VALUES)]
        stats, extremes = self._read_at_once(flat) if S.host_reads_free(flat.device) else self._masked(flat)
        row = self._keep(sample, copy=True, extremes=extremes)
        self.exact[row] = (stats, n)
        return row

    def _read_at_once(self, flat: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """``[finite count, min, max, sum, norm, (non-zeros), (variance)]`` of the finite values,
        read on the host (no device sync on the CPU), and the extremes as a tensor."""
        values, finite = [float(v) for v in self._statistics(flat)], flat.numel()
        if not math.isfinite(values[2] + values[3]):  # statistics over the finite values, as for every other tensor
            flat = flat[torch.isfinite(flat)]
            values, finite = [float(v) for v in self._statistics(flat)], flat.numel()
        return np.array([finite] + values), torch.tensor(values[:2])

    def _masked(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics of :meth:`_read_at_once` by masked ops, on the device: correct for any
        value, nothing read on the host."""
        finite_mask = torch.isfinite(flat)
        values = self._statistics(torch.where(finite_mask, flat, torch.zeros((), dtype=flat.dtype, device=flat.device)),
                                  variance=False)
        values[0] = torch.where(finite_mask, flat, math.inf).amin()
        values[1] = torch.where(finite_mask, flat, -math.inf).amax()
        finite = finite_mask.sum(dtype=torch.float64)
        if self.centered:  # the variance of the finite values alone, not of the zeros in place of the others
            dev = torch.where(finite_mask, flat - (values[2] / finite.clamp(min=1)).to(flat.dtype), 0.0)
            values.append(torch.dot(dev, dev) / finite.clamp(min=1))
        return torch.cat([finite.view(1), torch.stack(values).double()]), torch.stack(values[:2])

    def _statistics(self, flat: torch.Tensor, variance: bool = True) -> list[torch.Tensor]:
        """min, max, sum, norm (and non-zeros, variance when asked and ``variance``) of ``flat``,
        device scalars; no value (all were NaN/Inf): min inf, max -inf, variance NaN."""
        empty = flat.numel() == 0  # every value was NaN/Inf
        parts = [flat.new_tensor(math.inf) if empty else flat.amin(), flat.new_tensor(-math.inf) if empty else flat.amax(),
                 flat.sum(), torch.dot(flat, flat).sqrt()]  # dot: faster than vector_norm on the CPU, and closer
        if self.zeros:
            parts.append(torch.count_nonzero(flat))
        if self.centered and variance:
            parts.append(flat.new_tensor(math.nan) if empty else torch.var(flat, correction=0))
        return parts

    def rows(self, extra: list[torch.Tensor], spread: tuple[list[torch.Tensor], list[list[int]]] = ([], [])
             ) -> tuple[list[np.ndarray], np.ndarray]:
        """The ``extra`` pieces and every row, on the host (one transfer per device); the rows of
        outputs spread over ranks are ``spread`` (:meth:`spread_rows`)."""
        width = S.row_width(self.bins)
        if not self._offset:
            return S.to_host(extra), np.empty((0, width))
        spread_rows, spread_order = spread
        plain = [row for row in range(len(self._offset)) if row not in self.sharded]
        values = [self.kept[row] if self._offset[row] < 0 else self._stash[self._offset[row] : self._offset[row] + self._length[row]]
                  for row in plain]
        device_rows = [S.reduce(values, self.bins, zeros=self.zeros, centered=self.centered, workspace=self.workspace)] if values else []
        on_device = [stats for stats, _ in self.exact.values() if isinstance(stats, torch.Tensor)]  # else read by the hook
        host = S.to_host(extra + device_rows + spread_rows + on_device)
        extra_host, rest = host[: len(extra)], iter(host[len(extra) :])
        rows = np.empty((len(self._offset), width))
        if values:
            rows[plain] = next(rest).reshape(len(plain), width)
        for rows_of_group in spread_order:
            rows[rows_of_group] = next(rest).reshape(len(rows_of_group), width)
        for row, (stats, n) in self.exact.items():
            S.exact_row(rows[row], next(rest) if isinstance(stats, torch.Tensor) else stats, n, self.zeros, self.centered)
        return extra_host, rows

    @property
    def spread_counts(self) -> list[int]:
        """How many rows are of outputs spread over ranks, per process group (in order)."""
        return [len(rows) for rows in self._by_group().values()]

    def _by_group(self) -> dict[Any, list[int]]:
        by_group: dict[Any, list[int]] = {}
        for row, (group, _, _) in self.sharded.items():
            by_group.setdefault(group, []).append(row)
        return by_group

    def spread_rows(self, together: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        """The device rows of the outputs spread over ranks, one tensor per process group (in the
        order the groups came), and the rows each holds: with the other ranks' (``together``:
        collective, every rank calls it; :func:`~layerwatch.stats.combine_shards` never raises
        before its collectives are issued), or from this rank's shards alone."""
        out, order = [], []
        for group, rows in self._by_group().items():
            try:
                heads = torch.stack([self.sharded[row][1] for row in rows])
            except Exception:  # still takes part; combine_shards marks the rows failed
                heads = None
            samples = [self.sharded[row][2] for row in rows]
            device = samples[0].device
            out.append(S.combine_shards(heads, samples, len(rows), group if together else None, self.bins, device))
            order.append(rows)
        return out, order


def nonfinite_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s values, a device scalar: not finite exactly when ``t`` holds a NaN or
    Inf. One read pass, several times cheaper than ``isfinite(t).all()``; finite values whose
    float32 sum overflows (beyond ~3e38) read as non-finite."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()


def floats(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The dense floating (or complex) tensors of ``tensors``: those whose values can be NaN and
    can be reduced (one call for all of them)."""
    strided = torch.strided
    return [t for t in tensors if t.layout == strided and (t.is_floating_point() or t.is_complex())]

