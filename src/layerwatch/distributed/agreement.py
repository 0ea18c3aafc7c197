"""How the ranks agree: a fingerprint of what each holds, a CPU group to agree in
(:class:`RankSync`), and the ranks' vote on each step (:class:`StepVote`)."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from layerwatch.distributed.sharding import initialized


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
        if group is not None and initialized():
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
    value: the spike check's, see :class:`~layerwatch.health.spikes.Spikes`)."""

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
