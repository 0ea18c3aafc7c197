"""What the runtime probe's hooks keep of the tensors they see: NaN/Inf flags and stats rows.

One flag per distinct tensor (the same tensor, unchanged, seen again by another hook is the
same entry), and a row of statistics for the outputs measured: an entry ``>= 0`` is a slot of
:class:`~layerwatch.probes.outputs.FlagSlots`, an entry ``< 0`` the row ``-1 - entry`` (whose
NONFINITE column says it). A module call's inputs, outputs and gradients are runs of entries.
Everything stays on the device until :meth:`Evidence.read`, one transfer for all of it.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple, Optional

import torch

from layerwatch import stats as S
from layerwatch.distributed.agreement import fingerprint
from layerwatch.distributed.sharding import local, local_tensors, spread
from layerwatch.probes.outputs import FlagSlots, Outputs, nonfinite_sum
from layerwatch.stats.norms import fused_norms


class SpreadWork(NamedTuple):
    """What :meth:`Evidence.combine` does with the other ranks: how many flags and rows of
    spread tensors, and how they fall into process groups (in order). Every rank must hold
    the same, or none may combine. All zero: nothing to combine (or nothing to say)."""

    flag_groups: int = 0
    row_groups: int = 0
    flags: int = 0
    rows: int = 0
    layout: int = 0  # a fingerprint of the counts per group, in order


class Evidence:
    """The flags and rows of one sampled step's tensors (see the module)."""

    def __init__(self, bins: int, zeros: bool, centered: bool, workspace: S.Workspace) -> None:
        self._slots = FlagSlots(workspace)
        self.flags: list[int] = []  # the entries, in the order first seen
        self._runs: list[int] = []  # runs of entries: a length, then them
        self._outputs = Outputs(bins, zeros, centered, workspace)
        # id(tensor) -> a weak reference, and its version, flag and row packed in one int
        self._seen_ref: dict[int, Any] = {}
        self._seen_key: dict[int, int] = {}

    def forget(self) -> None:
        """Let go of the tensors seen (the hooks are removed)."""
        self._seen_ref, self._seen_key = {}, {}

    def spread_work(self) -> SpreadWork:
        """How many flags and rows of spread tensors, per group and in order: what every rank
        must hold alike before :meth:`combine`."""
        flags, rows = self._slots.spread_counts, self._outputs.spread_counts
        return SpreadWork(len(flags), len(rows), sum(flags), sum(rows), fingerprint([str(flags), str(rows)]))

    def combine(self) -> None:
        """The flags of spread tensors combined with the other ranks' (collective)."""
        self._slots.combine()

    def spread_rows(self, together: bool) -> Any:
        """The rows of spread tensors, combined with the other ranks' when ``together``."""
        return self._outputs.spread_rows(together)

    def read(self, extra: list[torch.Tensor], spread_rows: Any) -> tuple[list[bool], Any, list[Any]]:
        """One host transfer of every flag and row, and of the ``extra`` pieces: whether each
        entry is non-finite, the rows on the host, and the ``extra`` pieces on the host."""
        host_pieces, rows_host = self._outputs.rows(self._slots.pieces() + extra, spread_rows)
        slot_pieces = host_pieces[: len(host_pieces) - len(extra)]
        flagged = self._slots.flagged(slot_pieces)
        counts = S.Rows(rows_host).nonfinite
        nonfinite = [bool(counts[-1 - f] > 0) if f < 0 else bool(flagged[f]) for f in self.flags]
        return nonfinite, rows_host, host_pieces[len(slot_pieces):]

    def add_run(self, flags: list[int]) -> int:
        """Where a run of flag entries starts in ``_runs``."""
        start = len(self._runs)
        self._runs.append(len(flags))
        self._runs += flags
        return start

    def run(self, start: int) -> list[int]:
        """The flag entries of the run at ``start`` (none for -1)."""
        return [] if start < 0 else self._runs[start + 1 : start + 1 + self._runs[start]]

    def flag(self, t: torch.Tensor, group: Any = None) -> int:
        """The entry of the flag that holds whether ``t`` has a NaN or Inf; ``group``: the ranks
        ``t`` is a shard over, when ``t`` itself does not say so (a plain local shard)."""
        seen = self._seen(t)
        if seen is not None:
            return seen[0]
        values = t
        if type(t) is not torch.Tensor:  # a DTensor, maybe: its local part, and how it is spread
            how = spread(t)
            group = group if how is None else how.group
            values = local(t)
        self.flags.append(self._slots.add(nonfinite_sum(values.detach()), group))
        self._remember(t, len(self.flags) - 1, None)
        return len(self.flags) - 1

    def flag_together(self, tensors: list[torch.Tensor]) -> list[int]:
        """Flag entries, one per device and dtype, that say whether any of ``tensors`` has a NaN
        or Inf: the sum of their fused norms (:func:`~layerwatch.stats.norms.fused_norms`). An L2
        norm overflows float32 from ~1.8e19 (a GradScaler's first steps reach that), an L1 norm
        only from ~3.4e38 but is twice as slow on the CPU: there the L2 norm goes first, and a
        group whose L2 norm is not finite is measured again in L1 (reading it is no sync)."""
        first = len(self.flags)
        spread_ones = [t for t in tensors if type(t) is not torch.Tensor]  # DTensors, maybe
        groups = {how.group for how in map(spread, spread_ones) if how is not None}
        group = next(iter(groups)) if len(groups) == 1 else None  # FSDP: every gradient is a shard over one group
        if spread_ones:
            tensors = local_tensors(tensors)
        on_cpu = all(map(S.host_reads_free, {t.device for t in tensors}))
        for indices, norms in fused_norms(tensors, ord=2 if on_cpu else 1):
            total = norms.sum()
            if on_cpu and not math.isfinite(float(total)):
                ((_, norms),) = fused_norms([tensors[i] for i in indices], ord=1)
                total = norms.sum()
            self.flags.append(self._slots.add(total, group))
        return list(range(first, len(self.flags)))

    def row(self, tensors: list[torch.Tensor], group: Any = None) -> Optional[int]:
        """A stats row of the values of ``tensors`` together, shared with an identical earlier
        row (a container returning its last child's output). None for an output whose
        statistics this rank cannot make: a ``Partial`` DTensor (each rank holds a term of
        every value), one sharded along several mesh dimensions, or several outputs of which
        one is spread over ranks."""
        t = tensors[0]
        seen = self._seen(t) if len(tensors) == 1 else None
        if seen is not None and seen[1] is not None:
            return seen[1]
        if len(tensors) == 1 and type(t) is torch.Tensor:  # the common case
            values = t
        else:
            spreads = [spread(x) for x in tensors]
            if any(how is not None for how in spreads):
                if len(tensors) > 1 or spreads[0].kind != "shard":
                    return None
                group = spreads[0].group
            elif len(tensors) > 1 and group is not None:
                return None
            values = local(t) if len(tensors) == 1 else torch.cat([S.as_real_values(local(x)) for x in tensors])
        row = self._outputs.add(values, group)
        if len(tensors) == 1:
            self.flags.append(-1 - row)
            self._remember(t, len(self.flags) - 1, row)
        return row

    def _seen(self, t: torch.Tensor) -> Optional[tuple[int, Optional[int]]]:
        """(flag entry, row or None) of ``t`` when this very tensor, unchanged since, was seen."""
        key = self._seen_key.get(id(t))
        if key is None or self._seen_ref[id(t)]() is not t or key >> 64 != t._version:
            return None
        row = key & 0xFFFFFFFF
        return (key >> 32) & 0xFFFFFFFF, (row - 1 if row else None)

    def _remember(self, t: torch.Tensor, flag: int, row: Optional[int]) -> None:
        try:
            self._seen_ref[id(t)] = weakref.ref(t)
        except TypeError:  # a tensor type without weak references: not shared
            return
        self._seen_key[id(t)] = (t._version << 64) | (flag << 32) | (0 if row is None else row + 1)
