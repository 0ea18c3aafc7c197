"""What the runtime probe's hooks record of one sampled step (:class:`CallLog`), and which
families they record (:class:`Measures`).

The log is ints in flat lists: a module is its index in the probe's modules, a module call
is its position in the per-call lists, and the spans, events and flags are runs of ints. A
tuple, list or closure per module call would stay alive to the end of the step, and the
garbage collector walks every such object on each of its collections (on a model of 600
modules, that cost more than the hooks themselves)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence
from layerwatch.vocabulary import Family


@dataclass(frozen=True)
class Measures:
    """Which families the hooks record. ``forward_only``: a compiled model's eager re-run
    (engine/rerun.py), one forward with autograd off, recorded; nothing of a backward, of the bytes
    saved for it or of the allocator's growth (a forward without autograd frees what a
    training forward keeps): those stay None, never 0. ``cuda``: the model is on a GPU
    (timed with events, its allocator read)."""

    latency: bool
    memory: bool
    activations: bool
    nonfinite: bool
    forward_only: bool
    cuda: bool

    @classmethod
    def of(cls, families: Sequence[str], forward_only: bool, cuda: bool) -> "Measures":
        return cls(Family.LATENCY in families, Family.MEMORY in families, Family.ACTIVATIONS in families, Family.NONFINITE in families,
                   forward_only, cuda)

    @property
    def backward(self) -> bool:
        """Whether the hooks follow each call's backward."""
        return (self.latency or self.nonfinite) and not self.forward_only


class CallLog:
    """The record of one sampled step's module calls (see the module): per module, per call,
    and the hooks' own intervals, in firing order."""

    __slots__ = ("calls", "activation_bytes", "cuda_alloc_bytes", "module", "start", "inputs", "alloc",
                 "bwd_start", "grad_outputs", "in_group", "group", "entered", "left", "fwd_spans", "bwd_spans",
                 "fwd_events", "bwd_events", "row_of")

    def __init__(self, modules: int) -> None:
        self.calls = [0] * modules  # per module
        self.activation_bytes = [0] * modules
        self.cuda_alloc_bytes = [0] * modules
        # Per forward call (a call is its position in these lists): its module, the hook
        # interval after which it starts, its input flags (a run of Evidence's), the memory
        # allocated before it, the interval its backward starts at (-1: not yet) and the
        # flag of the gradient of its outputs (a run).
        self.module: list[int] = []
        self.start: list[int] = []
        self.inputs: list[int] = []
        self.alloc: list[int] = []
        self.bwd_start: list[int] = []
        self.grad_outputs: list[int] = []
        self.in_group: list[Any] = []  # the group its inputs are plain shards over, or None
        self.group: list[Any] = []  # idem, its outputs
        # Hook intervals: marks at entry and exit of every hook, in firing order.
        self.entered: list[Any] = []
        self.left: list[Any] = []
        self.fwd_spans: list[int] = []  # (module, start interval, end interval) after each other
        self.bwd_spans: list[int] = []
        self.fwd_events: list[int] = []  # (module, inputs run, outputs run) after each other
        self.bwd_events: list[int] = []
        self.row_of: dict[int, int] = {}  # module -> the stats row of its first call's outputs
