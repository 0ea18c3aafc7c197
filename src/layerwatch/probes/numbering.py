"""Small numbers for the live objects that operators in compiled graphs report to.

An opaque operator in a graph (``layerwatch::measure_call`` and the attention stand-ins') is
given the number of the object its body reports to, and that number is a constant of the
graph. ``id()`` differs from one process to the next, so every process would compile an armed
graph of its own, never found again in Inductor's caches (its FX graph and AOTAutograd caches):
each restart of a run would compile it again. :class:`Numbering` gives the smallest number no
live object holds, so a run makes the same graph in every process, and a second run in the
same process the first one's once the first has released its number.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterator, Optional


class Numbering:
    """Live objects by small number: the smallest free one at :meth:`add`, free again at
    :meth:`release` or once the object is gone."""

    def __init__(self) -> None:
        self._live: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()

    def add(self, obj: Any) -> int:
        number = next(n for n in itertools.count() if n not in self._live)
        self._live[number] = obj
        return number

    def get(self, number: int) -> Optional[Any]:
        return self._live.get(number)

    def release(self, number: int) -> None:
        self._live.pop(number, None)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._live.values()))
