"""What the probes of one sampled step measured, as plain host data: each module's
:class:`ModuleTrace`, the first :class:`Offender`, the whole :class:`ProbeResult`. Below every
reader: the record, the stages, the replay and the rules read it; nothing here imports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np

from layerwatch.routing import concentration, dead_experts, imbalance


@dataclass
class ModuleTrace:
    """One module's measurements on a sampled step (host values)."""

    name: str
    calls: int = 0
    # None where the family is off (or, for bwd_ms, where no backward was seen).
    fwd_ms: Optional[float] = None
    bwd_ms: Optional[float] = None
    activation_bytes: Optional[int] = None
    saved_bytes: Optional[int] = None
    cuda_alloc_bytes: Optional[int] = None
    nonfinite: Optional[bool] = None
    activation_row: Optional[np.ndarray] = None  # stats row of its first call's outputs


@dataclass
class Offender:
    """The first module whose inputs were finite and whose outputs were not."""

    name: str
    phase: str  # "forward" or "backward"
    replayed_from: Optional[int] = None  # found by running this step's batch again (see faults/replay.py)
    replayed_what: str = ""  # which part of it, when not all: "micro-batch 2 of 4", "rank 1's batch"

    def describe(self, step: int) -> str:
        what = "output" if self.phase == "forward" else "gradient with respect to its inputs (or parameters)"
        given = "inputs" if self.phase == "forward" else "gradient with respect to its outputs"
        text = f"step {step}, {self.phase}: {self.name} turned finite {given} into a non-finite {what}"
        if self.replayed_from is not None:
            text += f" (replayed from step {self.replayed_from}{', ' + self.replayed_what if self.replayed_what else ''})"
        return text


@dataclass
class ProbeResult:
    modules: list[ModuleTrace]  # the modules called during the step, in model order
    offender: Optional[Offender]
    # The first module that made a non-finite value from finite inputs with a weight that was
    # non-finite already (it used the fault, it did not make it), and those weights' names.
    weight_user: Optional[Offender] = None
    nonfinite_weights: list[str] = field(default_factory=list)
    attention: dict = field(default_factory=dict)  # module -> [heads, 2]: largest logit, entropy (probes/attention.py)
    logits: Optional[tuple] = None  # (the output head, [mean, max] of log Z) (probes/logits.py)
    kurtosis: dict = field(default_factory=dict)  # module -> its output's per-channel kurtosis (probes/kurtosis.py)
    routers: dict = field(default_factory=dict)  # router module -> its RouterLoad (probes/routers.py)
    rerun: bool = False  # measured on a compiled model's eager, forward-only re-run (engine/rerun.py)


@dataclass
class RouterLoad:
    """One Mixture-of-Experts router's routing on a sampled step (host values; probes/routers.py),
    summed over the step's micro-batches and, in a data-parallel run, over the ranks."""

    tokens: np.ndarray  # [experts] tokens routed to each expert (each token counts once per expert it is sent to)
    entropy: Optional[float] = None  # mean over tokens of the entropy of softmax(logits), nats; None: no logits seen
    margin: Optional[float] = None  # mean over tokens of the first routing probability less the second
    z_mean: Optional[float] = None  # mean over tokens of logsumexp(logits)
    z_max: Optional[float] = None  # its largest
    dropped: Optional[int] = None  # tokens a capacity limit dropped; None: the router has no capacity limit
    bias: Optional[np.ndarray] = None  # [experts] the aux-free balancing bias, where the router has one
    top_k: Optional[int] = None  # experts each token is sent to; None: not known

    @property
    def imbalance(self) -> float:
        """max over experts of tokens / mean tokens (1: balanced); NaN when no token was routed."""
        return imbalance(self.tokens)

    @property
    def concentration(self) -> float:
        """How far the busiest expert is from its fair share toward every token (:func:`concentration`)."""
        return concentration(self.tokens, self.top_k)

    @property
    def dead(self) -> int:
        """How many experts got no token."""
        return int(dead_experts(self.tokens).sum())


class Signals(NamedTuple):
    """What the transformer probes measured on a sampled step (TransformerProbes.take), on the host."""

    attention: dict = {}  # module -> [heads, 2]: largest logit, entropy
    logits: Optional[tuple] = None  # (the output head, [mean, max] of log Z)
    kurtosis: dict = {}  # module -> its output's per-channel kurtosis
    routers: dict = {}  # router module -> RouterLoad
