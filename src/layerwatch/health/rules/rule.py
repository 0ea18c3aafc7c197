"""The one shape of a health rule: given what a sampled step shows (:class:`Seen`), the rules it
finds broken (:class:`Broken`), each in words a person understands.

:class:`~layerwatch.health.check.HealthMonitor` asks its rules in turn, at every sample, and
raises each ``(kind, layer)`` they find once. A rule keeps what it needs of the past itself;
when the loss reaches a new lowest it is told to :meth:`Rule.restart` (the growth rules judge
afresh from there; the others keep their state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol, Sequence

import numpy as np

from layerwatch import stats as S
from layerwatch.vocabulary import parent


class Broken(NamedTuple):
    """A rule broken: its alert's kind, the layer it names, and its message."""

    kind: str
    layer: str
    message: str


class Tensors(NamedTuple):
    """One family's tensors at a sample: each one's slot (its parameter's index in
    :attr:`Seen.names`) and their stats rows (``stats`` columns, on the host)."""

    slots: np.ndarray
    rows: S.Rows


@dataclass(frozen=True)
class Seen:
    """What a sampled step gives the rules."""

    step: int
    names: Sequence[str]  # every parameter seen so far, by slot (in the order first seen)
    layers: Sequence[str]  # each slot's layer: its parameter's parent module
    weights: Tensors  # empty when weights are not read
    grads: Optional[Tensors]  # None when gradients are not read, or not judged at this step
    trainable: np.ndarray  # the slots of the parameters with ``requires_grad``
    adam: Sequence[tuple[list[str], np.ndarray]] = ()  # Adam's state after the step (names and rows)
    probes: Any = None  # the step's ProbeResult (attention, output logits, activation rows, kurtosis), or None
    turned: bool = True  # the loss has turned: the growth rules (GROWTH_KINDS) judge


class Rule(Protocol):
    """A health rule. Those of :mod:`layerwatch.health.rules` subclass it, and so take its
    :meth:`restart`, which keeps their state."""

    def observe(self, seen: Seen) -> list[Broken]:
        """The rules broken at this sample, in the order they are to be raised."""
        ...

    def restart(self) -> None:
        """The loss made a new lowest: judge growth afresh from here (what grew while it fell is
        learning). A rule that judges no growth keeps its state."""


def owner(param: str) -> str:
    """The layer an alert on parameter ``param`` names: its module, or itself at the root."""
    return parent(param) or param


def grown(array: np.ndarray, size: int, fill: Any) -> np.ndarray:
    """``array`` (one entry a slot) with room for ``size`` slots, new ones ``fill``; itself
    when it has room (it at least doubles, so that growing is rare)."""
    if size <= len(array):
        return array
    extra = max(size, 2 * len(array)) - len(array)
    return np.concatenate([array, np.full((extra,) + array.shape[1:], fill, dtype=array.dtype)])
