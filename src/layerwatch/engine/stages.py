"""Pipeline stages (``torch.distributed.pipelining``): each rank measures the layers of its own
stage, and the one writer (global rank 0) logs every stage's layers under their names in the
unsplit model.

A run is *staged* when it is distributed, ``torch.distributed.pipelining`` is loaded, and the
ranks' models hold different parameters: each rank watches the module of its stage, cut from
a copy of the whole model so that it keeps the whole model's qualified names (torchtitan's
manual split: layers of other stages deleted from a ``ModuleDict``, the other top-level
modules set to None). :func:`find_stages` tells, once, at ``start()``.

Then every rank samples the same steps (the engine's :class:`~layerwatch.distributed.agreement.StepVote`,
as in a sharded run), measures its own stage alone (no collective), and at the end of each
sampled step sends what it measured, as plain host data, to the writer (:meth:`Stages.gather`):
the rows of its tensors, its probes' per-module result, and which of its parameters are
trainable. Every rank issues the same two collectives of that exchange (``gather_object``:
an ``all_gather`` of sizes, then a ``gather`` of bytes) on a gloo group of the whole world made
for it, with a timeout, at every sampled step, whatever its own measuring did: a rank whose
part failed sends a part that says so.

A module present on several stages (the model itself, and any container that is cut) runs a
different part of the model on each, so its per-module values are no one module's: they are
left out. Pipelining's first step runs each stage's forward once more on made-up inputs, to
infer the shapes it sends (:func:`~layerwatch.distributed.pipelining.in_shape_inference`): the runtime probes do not count it.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from layerwatch.distributed.agreement import RankSync
from layerwatch.distributed.pipelining import PIPELINING
from layerwatch.distributed.sharding import is_writer_rank, world_size

from layerwatch.guards.failures import FailurePolicy
from layerwatch.probes.result import Offender, ProbeResult
from layerwatch.stats.rows import HostRows

EXCHANGE_TIMEOUT_S = 300.0  # how long a rank waits for the others at the start, or at a sampled step's exchange


@dataclass
class StagePart:
    """What one rank measured of its stage at a sampled step (or, merged by
    :meth:`Stages.merge`, what every stage did), as plain host data."""

    rows: Optional[HostRows]  # its tensors' rows by family; None: this rank could not read them
    probes: Optional[ProbeResult]  # its per-module measurements; None: off, or failed on this rank
    trainable: list[str] = field(default_factory=list)  # its parameters with requires_grad
    complete: bool = True  # (merged) every stage's rows are in: the run-wide gradient norm is exact


_NOTHING = StagePart(None, None)  # what a rank whose part cannot be sent sends


@dataclass(frozen=True)
class Held:
    """What one rank's model holds, as it tells the others at the start."""

    params: tuple[str, ...]  # its parameters' clean names
    modules: tuple[str, ...]  # its probed modules' names
    sharded: bool  # some of its parameters are shards (FSDP, tensor parallel, ZeRO)


def find_stages(held: Held, failures: FailurePolicy) -> Optional[Stages]:
    """The pipeline stages of this run, or None when it has none (or none layerwatch can
    measure as stages: said once). Every rank calls it at the same point of ``start()``: when
    pipelining is loaded in a distributed run it makes the ranks' group and exchanges ``held``
    (collective); otherwise it does nothing."""
    if world_size() == 1 or PIPELINING not in sys.modules:
        return None
    sync = RankSync(EXCHANGE_TIMEOUT_S)
    try:
        every: list[Held] = sync.all(held)
        problem = _unmeasurable(every)
    except BaseException:
        sync.close()
        raise
    if problem is None and len({h.params for h in every}) > 1:
        return Stages(sync, every, failures)
    sync.close()
    if problem is not None and is_writer_rank():
        failures.warn(f"layerwatch: the ranks hold different parts of the model (pipeline stages), but {problem}; only "
                      "rank 0's own layers are measured, and the run-wide figures are rank 0's")
    return None


def _unmeasurable(every: Sequence[Held]) -> Optional[str]:
    """Why the ranks' different models cannot be measured as pipeline stages, or None."""
    if len({h.params for h in every}) == 1:
        return None
    if any(h.sharded for h in every):
        return "some of their parameters are also sharded (FSDP, tensor parallel or ZeRO within a stage), which is not supported"
    owner: dict[str, tuple[str, ...]] = {}
    twice = [name for h in dict.fromkeys(every) for name in h.params if owner.setdefault(name, h.params) != h.params]
    if twice:
        names = ", ".join(twice[:3]) + (f" and {len(twice) - 3} more" if len(twice) > 3 else "")
        return (f"several stages hold parameters of the same name ({names}): weights tied across stages, or stage "
                "modules that do not keep the whole model's names (an nn.ModuleList or nn.Sequential rebuilt from the "
                "kept layers numbers them anew; delete the others from an nn.ModuleDict, as torchtitan does)")
    return None


class Stages:
    """The pipeline stages of a run: the names of every stage's layers, and the exchange that
    brings each stage's measurements to the writer at a sampled step.

    A stage's measurements are those of the first rank that holds it (the others, data
    parallel replicas of it, still take part in every exchange). Stages are in rank order.
    """

    def __init__(self, sync: RankSync, every: Sequence[Held], failures: FailurePolicy) -> None:
        self._sync = sync
        self._failures = failures
        held = [h.params for h in every]
        self.ranks = [rank for rank, params in enumerate(held) if held.index(params) == rank]  # the first of each stage
        stages = [every[rank] for rank in self.ranks]
        seen: dict[str, int] = {}
        for h in stages:
            for name in dict.fromkeys(h.modules):
                seen[name] = seen.get(name, 0) + 1
        self.shared = {name for name, count in seen.items() if count > 1}  # modules cut between stages
        self.params = [name for h in stages for name in h.params]
        self.modules = [name for name in seen if name not in self.shared]

    def remove(self) -> None:
        """Close the exchange's group (the engine's attachments call it; safe twice)."""
        self._sync.close()

    def gather(self, step: int, rows: Callable[[], HostRows], probes: Optional[ProbeResult],
               trainable: Callable[[], list[str]]) -> Optional[StagePart]:
        """Every rank, at the end of every sampled step, whatever its own measuring did: read
        this rank's ``rows()`` to the host and send them, its ``probes``' result and its
        ``trainable()`` parameters' names to the writer. Nothing raises before the exchange's
        collectives are issued. Returns, on the writer, every stage's measurements merged (its
        own alone where the exchange failed, said once); None elsewhere."""
        own = self._failures.run("read this stage's tensors to the host", lambda: (rows(), trainable()), step)
        part = StagePart(own[0], probes, own[1]) if own is not None else StagePart(None, probes)
        parts = self._exchange(part, step)
        if not is_writer_rank():
            return None
        return self.merge(parts or [part] + [None] * (world_size() - 1), step)

    def _exchange(self, part: StagePart, step: int) -> Optional[list[Optional[StagePart]]]:
        """Every rank's part, on the writer (None elsewhere, or when the exchange failed: said
        once, and not tried again). The writer keeps its own; a part that cannot be pickled is
        sent as :data:`_NOTHING`, so that its rank still issues the collectives; one that
        cannot be read is None."""
        import torch.distributed as dist

        group = self._sync.group
        if group is None:
            return None
        try:
            data = b"" if is_writer_rank() else pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            self._failures.warn_once("stage-pickle", f"layerwatch: could not send this stage's measurements at step {step}: "
                                     f"{e!r}; they are left out")
            data = pickle.dumps(_NOTHING)
        received: Optional[list[Any]] = [None] * dist.get_world_size() if is_writer_rank() else None
        try:
            dist.gather_object(data, received, dst=0, group=group)
        except Exception as e:
            self._sync.close()
            self._failures.warn_once(
                "stage-exchange",
                f"layerwatch: the ranks of the pipeline stages could not exchange their measurements at step {step} "
                f"({e!r}); from now on only rank 0's own stage is logged",
            )
            return None
        if received is None:
            return None
        parts: list[Optional[StagePart]] = []
        for rank, payload in enumerate(received):
            try:
                parts.append(part if rank == 0 else pickle.loads(payload))
            except Exception:
                parts.append(None)
        return parts

    def merge(self, parts: Sequence[Optional[StagePart]], step: int) -> StagePart:
        """Every stage's measurements as one: the rows of each family and the modules in stage
        order, less the modules present on several stages; the first offender as the
        pipeline's order gives it (:func:`first_offender`). A stage whose rows or probes are
        missing is left out of the step, said once; the run-wide gradient norm is then not
        whole (``complete`` False)."""
        stages = [parts[rank] for rank in self.ranks]
        rows: HostRows = {}
        for part in stages:
            for family, pieces in ((part and part.rows) or {}).items():
                rows.setdefault(family, []).extend(pieces)
        no_rows = [rank for rank, part in zip(self.ranks, stages) if part is None or part.rows is None]
        if no_rows:
            self._failures.warn_once("stage-rows", f"layerwatch: rank(s) {_listed(no_rows)} could not read or send their "
                                     f"stage's weights and gradients at step {step}; they are left out of such steps, and "
                                     "so is layerwatch/grad_norm")
        results = [None if part is None else part.probes for part in stages]
        present = [result for result in results if result is not None]
        probes = None
        if present:
            if len(present) < len(results):
                missing = [rank for rank, result in zip(self.ranks, results) if result is None]
                self._failures.warn_once("stage-probes", f"layerwatch: rank(s) {_listed(missing)} sent no per-module "
                                         f"measurements of their stage at step {step} (probes off or failed there); "
                                         "their modules are left out of such steps")
            modules = [trace for result in present for trace in result.modules if trace.name not in self.shared]
            probes = dataclasses.replace(
                present[0], modules=modules,
                offender=first_offender(results), weight_user=first_offender(results, "weight_user"),
                nonfinite_weights=[name for result in present for name in result.nonfinite_weights],
                attention={name: heads for result in present for name, heads in result.attention.items()},
                logits=next((result.logits for result in reversed(present) if result.logits is not None), None),
                kurtosis={name: value for result in present for name, value in result.kurtosis.items()},
                routers={name: load for result in present for name, load in result.routers.items()},
            )
        # A stage whose rows are missing has no gradients to judge: its parameters are not "trainable, no gradient".
        trainable = [name for part in stages if part is not None and part.rows is not None for name in part.trainable]
        return StagePart(rows, probes, trainable, complete=not no_rows)


def first_offender(results: Sequence[Optional[ProbeResult]], which: str = "offender") -> Optional[Offender]:
    """The pipeline's first offender (``which="weight_user"``: its first user of a non-finite
    weight) from each stage's probes, in stage order (None: that stage's are missing). A
    micro-batch's forward runs through the stages in order and its backward in reverse, so a
    forward offender of the earliest stage comes first, else a backward offender of the
    latest. Where a stage that may have come before it is missing, none is named."""
    for result in results:
        if result is None:
            return None
        offender = getattr(result, which)
        if offender is not None and offender.phase == "forward":
            return offender
    for result in reversed(results):
        offender = getattr(result, which)
        if offender is not None and offender.phase == "backward":
            return offender
    return None


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
