"""What the ranks of a sharded run agree on before they combine their probes' measurements
(:class:`ProbeTerms`): one record, sent as one fixed-length vector of ints in one
``all_reduce`` (:meth:`~layerwatch.distributed.agreement.RankSync.same`). Its length is its
type's, whatever its values, so that the collective matches on every rank."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from layerwatch.probes.evidence import SpreadWork


class ProbeTerms(NamedTuple):
    """One rank's terms: whether its runtime probes are on, whether they worked (armed, no
    failure), the spread tensors they would combine (:class:`SpreadWork`) and the weights'
    check (how many it read, -1: none). A rank whose probes did not work sends zeros for
    the rest, as every rank sends the same length."""

    runtime_on: bool
    healthy: bool = False
    work: SpreadWork = SpreadWork()
    checked: int = 0

    @classmethod
    def width(cls) -> int:
        """How many ints every rank sends: fixed by the type."""
        return len(cls._fields) - 1 + len(SpreadWork._fields)

    def vector(self) -> list[int]:
        """The ints this rank sends: ``runtime_on, healthy``, the spread work, ``checked``."""
        return [int(self.runtime_on), int(self.healthy), *self.work, self.checked]

    @classmethod
    def from_vector(cls, values: Sequence[int]) -> "ProbeTerms":
        """The terms :meth:`vector` made ``values`` of."""
        if len(values) != cls.width():
            raise ValueError(f"{len(values)} ints, not the {cls.width()} of ProbeTerms")
        return cls(bool(values[0]), bool(values[1]), SpreadWork(*values[2:-1]), values[-1])
