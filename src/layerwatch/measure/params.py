"""The parameter families: weights, gradients and update ratios, reduced where they live.

Every tensor of one device goes through one batched :func:`layerwatch.stats.reduce`; the
rows stay on the device until the step's single transfer. Histograms of a tensor above
``HISTOGRAM_VALUES`` values come from a strided sample of it (its statistics stay exact).

Exact update ratios copy every trainable weight before the optimizer step. When that copy
does not fit (the ``memory_budget`` option; on a GPU, its free memory less a margin), the
snapshot holds a fixed strided sample of each weight instead, and the ratios of that step are
estimates (``update_ratio_estimate/<param>``), said once; they are exact again once it fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.distributed.agreement import RankSync, fingerprint
from layerwatch.distributed.sharding import Layout, NamedTensors, is_writer_rank, local_tensors, norms, parameter_layout, this_ranks_groups
from layerwatch.guards.failures import FailurePolicy
from layerwatch.measure.experts import ExpertRows, find_splits
from layerwatch.options import Options
from layerwatch.vocabulary import Family

HISTOGRAM_VALUES = S.HISTOGRAM_VALUES
SNAPSHOT_VALUES = S.HISTOGRAM_VALUES  # values of each weight an estimated update ratio samples
CUDA_MARGIN = 0.05  # of the device's memory, left free when a snapshot is taken on a GPU

Piece = tuple[list[str], torch.Tensor]  # names, and their packed rows on one device
Reading = tuple[list[Piece], list[Piece]]  # a family's pieces: the whole tensors', their experts' slices' (<param>[e])


@dataclass
class Snapshot:
    """The trainable weights just before the optimizer step: whole, or (``estimated``) a
    strided sample of each, ``strides[i]`` of group ``i``'s tensors."""

    groups: list[tuple[Any, list[str], Optional[list[torch.Tensor]]]]
    estimated: bool = False
    strides: list[list[int]] = field(default_factory=list)


def free_memory(device: torch.device) -> Optional[int]:
    """The bytes a snapshot may take on ``device``: on a GPU its free memory, and what its
    caching allocator holds unused, less ``CUDA_MARGIN`` of its memory; None elsewhere (no
    limit but ``memory_budget``)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + unused - CUDA_MARGIN * total)


class ShardedTerms(NamedTuple):
    """What the ranks of a sharded run agree on before they reduce a family's sharded tensors
    together: whether this rank failed to list them, how many groups and tensors it holds, and a
    fingerprint of their names. Sent as one vector of four ints, whatever the values."""

    failed: bool
    groups: int
    tensors: int
    fingerprint: int

    def vector(self) -> list[int]:
        return [int(self.failed), self.groups, self.tensors, self.fingerprint]


class ParameterFamilies:
    """Reads the weights, gradients and updates of the parameters this rank measures.

    Sharded parameters are reduced by every rank of their group together. Before each such
    reduction the ranks check that they hold the same list of tensors (``sync``): where they
    do not, every rank skips it, so no rank is left waiting in a collective the others will
    not issue.

    Each family is read as a :data:`Reading`: the whole tensors' pieces, and with the ``moe``
    family the pieces of the fused expert parameters' slices (:mod:`~layerwatch.measure.experts`).
    """

    def __init__(self, options: Options, failures: FailurePolicy) -> None:
        self.options = options
        self.failures = failures
        self.workspace = S.Workspace()
        self.layout = Layout()  # how the parameters lie over the ranks (given at start)
        self.zero: Any = None  # a DeepSpeed ZeRO run's pieces (layerwatch.measure.zero.Zero), given at start
        self.sync: Optional[RankSync] = None  # where the ranks of a sharded run agree
        self.experts = ExpertRows()  # the fused expert parameters (given at start)
        self._unmeasurable: set[tuple[str, str]] = set()  # (weights|gradients, name) whose statistics failed
        self.param_bytes = 0  # this rank's share of the model's parameters (see start_snapshots)
        self._held_bytes = 0  # what this step's snapshots hold so far
        self._estimating_since: Optional[int] = None  # the step since which snapshots are samples

    def start(self, layout: Layout, zero: Any, sync: Optional[RankSync], model: Optional[nn.Module] = None) -> None:
        """Where the parameters live (found at the run's start): their layout, a ZeRO run's
        partitions, and the ranks' group a sharded run's reductions agree in (None: none); with
        the ``moe`` family, ``model``'s fused expert parameters."""
        self.layout, self.zero, self.sync = layout, zero, sync
        if model is not None and Family.MOE in self.options.families:
            self.experts.start(self.failures.run("find the fused expert parameters", lambda: find_splits(
                model, self.options.moe_routers, layout, zero, self.failures.say_once), 0, otherwise={}))

    def release(self) -> None:
        self.sync = None
        self.workspace.clear()

    def gradients(self, params: Sequence[tuple[str, nn.Parameter]], step: int) -> Reading:
        if self.zero is not None:  # the averaged gradients in DeepSpeed's partitions, of the group it steps now
            return self.reduce(self.zero.gradients(params), "gradients")
        pairs, pieces = [], self.layout.pieces
        for name, p in params:
            grad = p.grad
            if grad is None and name in pieces:  # an empty FSDP1 piece: every rank lists it
                grad = self.layout.missing_gradient(name, p)
            if grad is None:
                continue
            if grad.is_sparse:
                self.failures.warn_once(f"sparse:{name}", f"layerwatch: the gradient of {name!r} is sparse; it is not measured")
                continue
            pairs.append((name, grad))
        if not pairs and any(p.requires_grad for _, p in params):
            self.failures.warn_once(
                "no-grads",
                f"layerwatch: no gradients at sampled step {step}; call inspector.step() after "
                "optimizer.step() and before optimizer.zero_grad(), or pass optimizer=",
            )
        return self.reduce(pairs, "gradients")

    def weights(self, params: Sequence[tuple[str, nn.Parameter]]) -> Reading:
        return self.reduce(self._values(params), "weights")

    def _values(self, params: Sequence[tuple[str, nn.Parameter]]) -> NamedTensors:
        """The parameters' values this rank holds: themselves, or their DeepSpeed ZeRO pieces."""
        return params if self.zero is None else self.zero.weights(params)

    def start_snapshots(self, param_bytes: int) -> None:
        """A sampled step's first snapshot comes: none is held yet, and ``param_bytes`` (this
        rank's share of the model's parameters) is what a ``memory_budget`` share is of."""
        self.param_bytes = param_bytes
        self._held_bytes = 0

    def snapshot(self, params: Sequence[tuple[str, nn.Parameter]], step: int, slot: str = "snapshot") -> Snapshot:
        """Copies of the trainable weights, in workspace buffers named ``slot`` + a number
        (several snapshots alive at once need different slots); strided samples of them when
        the copies do not fit (:meth:`_fits`). Never raises: a group that cannot be copied is
        left out (plain tensors) or kept without copies (sharded ones, whose update norms
        every rank still reduces: they read as failed)."""
        with torch.no_grad():
            trainable = self._values([(n, p) for n, p in params if p.requires_grad])
            found = self.groups(trainable, "snapshot")
            estimated = not self._fits([t for _, _, tensors in found for t in tensors])
            if self.sync is not None and [group for group, _, _ in found if group is not None]:
                agreed = self.sync.same([int(estimated)])  # on every rank, whatever it found
                estimated = estimated or not agreed  # a rank short of memory: all sample
            self._say_estimating(estimated, step)
            if estimated:  # the whole copy a CPU run keeps between samples does not fit either
                self.workspace.drop("snapshot")
            snapshot = Snapshot([], estimated)
            for i, (group, names, tensors) in enumerate(found):
                strides = [S.prime_stride(t.numel(), SNAPSHOT_VALUES) if estimated else 1 for t in tensors]
                try:
                    copies = self._samples(tensors, strides) if estimated else self._copies(tensors, f"{slot}{i}")
                except Exception as e:
                    self.failures.warn_once("fail:snapshot", f"layerwatch: could not snapshot weights for update ratios: {e!r}; skipped")
                    if group is None:
                        continue
                    copies = None
                snapshot.groups.append((group, names, copies))
                snapshot.strides.append(strides)
        self._held_bytes += sum([t.numel() * t.element_size() for _, _, copies in snapshot.groups for t in copies or []])
        return snapshot

    def _fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether whole copies of ``tensors`` fit: within ``memory_budget`` with what this
        step's snapshots hold already, and on each GPU within its free memory (and what its
        caching allocator holds unused) less a margin."""
        needed: dict[torch.device, int] = {}
        for device, size in [(t.device, t.numel() * t.element_size()) for t in tensors]:
            needed[device] = needed.get(device, 0) + size
        limit = self.options.memory_budget
        if limit is not None:
            allowed = limit if isinstance(limit, int) else limit * self.param_bytes
            if self._held_bytes + sum(needed.values()) > allowed:
                return False
        for device, size in needed.items():
            free = free_memory(device)
            if free is not None and size > free:
                return False
        return True

    def _say_estimating(self, estimated: bool, step: int) -> None:
        """Said once when update ratios become estimates, and each time they are exact again."""
        if estimated and self._estimating_since is None:
            self._estimating_since = step
            if is_writer_rank():
                self.failures.warn(
                    f"layerwatch: from step {step} the weights' snapshot for exact update ratios does not fit in memory "
                    f"({self._budget_text()}); update ratios are estimated from a strided sample of at most "
                    f"{SNAPSHOT_VALUES} values of each weight and logged as update_ratio_estimate/<param>, until it fits"
                )
        elif not estimated and self._estimating_since is not None:
            self._estimating_since = None
            if is_writer_rank():
                self.failures.say(f"layerwatch: update ratios are exact again from step {step}: the snapshot fits")

    def _budget_text(self) -> str:
        limit = self.options.memory_budget
        if limit is None:
            return f"a GPU's free memory, less {CUDA_MARGIN:.0%} of it"
        return f"memory_budget={limit!r}" + ("" if isinstance(limit, int) else f" of {self.param_bytes} parameter bytes")

    @staticmethod
    def _samples(tensors: list[torch.Tensor], strides: list[int]) -> list[torch.Tensor]:
        """Copies of a strided sample of each tensor: the same values :meth:`updates` reads."""
        return [t.reshape(-1)[::stride].clone() for t, stride in zip(tensors, strides)]

    def _copies(self, tensors: list[torch.Tensor], slot: str) -> list[torch.Tensor]:
        """Copies of ``tensors`` in one buffer of the workspace, kept for the next sample on the
        CPU (a fresh copy of a large weight costs a page fault per 4 KiB there); per-tensor
        clones when their dtypes differ."""
        dtype = tensors[0].dtype
        if any([t.dtype != dtype or t.device != tensors[0].device for t in tensors]):
            return [t.detach().clone() for t in tensors]
        sizes = [t.numel() for t in tensors]
        flat = self.workspace.get(tensors[0].device, dtype, sum(sizes), slot, exact=True)
        copies = [piece.view(t.shape) for piece, t in zip(flat.split(sizes), tensors)]
        torch._foreach_copy_(copies, tensors)  # under no_grad: nothing recorded, no detach needed
        return copies

    def _release_snapshots(self) -> None:
        """Give an accelerator's snapshot memory back (its caching allocator reuses it anyway)."""
        self.workspace.drop("snapshot", keep_cpu=True)
        self._held_bytes = 0

    def updates(self, snapshot: Snapshot, params: Sequence[tuple[str, nn.Parameter]], weight_norms: bool) -> Reading:
        """Rows ``[‖Δw‖, ‖w‖]`` of each snapshotted parameter (two rows per piece), ``w`` after
        the step; ``‖w‖`` is NaN unless ``weight_norms`` (the weights' own rows hold it), or
        the snapshot is ``estimated`` (both norms then come from the same strided sample; no
        expert's slices then)."""
        current = dict(self._values(params))
        pieces: list[Piece] = []
        experts: list[Piece] = []
        with torch.no_grad():
            for (group, names, before), strides in zip(snapshot.groups, snapshot.strides):
                after = local_tensors([current[name] for name in names])
                if snapshot.estimated:
                    after = [t.reshape(-1)[::stride] for t, stride in zip(after, strides)]
                if before is not None:
                    torch._foreach_sub_(before, after)
                deltas = norms(before, group, len(names), after[0].device)
                measure = weight_norms or snapshot.estimated
                after_norms = norms(after, group) if measure else torch.full_like(deltas, float("nan"))
                pieces.append((names, torch.stack([deltas, after_norms])))
                if self.experts.splits and not snapshot.estimated:
                    experts += self._expert_rows("updates", self.experts.update_norms, group, names, before, after, weight_norms)
        self._release_snapshots()
        return pieces, experts

    def reduce(self, pairs: NamedTensors, what: str) -> Reading:
        """Rows of ``what`` ("weights" or "gradients") of the named tensors this rank reduces, and
        of their experts' slices."""
        options, pieces, experts = self.options, [], []
        measurable = [(name, t) for name, t in pairs if (what, name) not in self._unmeasurable]
        for group, names, tensors in self.groups(measurable, what):
            if group is not None:  # collective: every rank must take part in step with the others
                pieces.append((names, S.reduce_sharded(tensors, group, options.bins, zeros=options.zeros,
                                                       centered=options.centered, histogram_values=HISTOGRAM_VALUES)))
            else:
                try:
                    rows = S.reduce(
                        tensors, options.bins, zeros=options.zeros, centered=options.centered,
                        histogram_values=HISTOGRAM_VALUES, workspace=self.workspace,
                    )
                    pieces.append((names, rows))
                except Exception:
                    pieces.append(self._reduce_one_by_one(what, names, tensors))
            if self.experts.splits:  # after the whole tensors', in the same order on every rank
                experts += self._expert_rows(what, self.experts.reduce, group, names, tensors)
        return [(names, rows) for names, rows in pieces if names], experts

    def _expert_rows(self, what: str, read: Callable[..., Optional[Piece]], group: Any, *args: Any) -> list[Piece]:
        """The piece ``read`` (:class:`~layerwatch.measure.experts.ExpertRows`' reduce or
        update_norms) makes of a group's experts: none where the group has no fused expert
        parameter, or where this rank's own tensors cannot be sliced (said once; a sharded
        group's ranks take part in its reduction whatever they hold)."""
        try:
            piece = read(group, *args)
        except Exception as e:
            self.failures.warn_once(f"experts:{what}", f"layerwatch: could not read the experts' slices of the {what}: "
                                    f"{e!r}; their rows <param>[e] are left out")
            return []
        return [] if piece is None else [piece]

    def groups(self, pairs: NamedTensors, what: str) -> list[tuple[Any, list[str], list[torch.Tensor]]]:
        """:func:`~layerwatch.distributed.sharding.this_ranks_groups`, less the sharded groups whose
        tensors are not the same on every rank (said once; every rank leaves them out alike)."""
        if self.sync is None:
            return this_ranks_groups(pairs, self.failures.warn_once, self.layout)
        try:
            groups, error = this_ranks_groups(pairs, self.failures.warn_once, self.layout), None
        except Exception as e:  # this rank still says so to the others, who wait for it
            groups, error = [], e
        sharded = [names for group, names, _ in groups if group is not None]
        every = [name for names in sharded for name in names]
        names = fingerprint(every) ^ self.experts.fingerprint  # the experts' rows each tensor brings, too
        agreed = self.sync.same(ShardedTerms(error is not None, len(sharded), len(every), names).vector())
        if error is not None:
            raise error
        if agreed:
            return groups
        self.failures.warn_once(
            f"ranks-differ:{what}",
            f"layerwatch: the ranks hold different lists of sharded {what} at this step; they are left out (every rank "
            "alike, so none waits for the others)",
        )
        return [entry for entry in groups if entry[0] is None]

    def _reduce_one_by_one(self, what: str, names: list[str], tensors: list[torch.Tensor]) -> Piece:
        """After a batched reduction failed: the tensors that can be measured, and a one-time
        warning naming each that cannot (it is left out from then on)."""
        options, kept, rows = self.options, [], []
        for name, tensor in zip(names, tensors):
            try:
                rows.append(S.reduce([tensor], options.bins, zeros=options.zeros, centered=options.centered,
                                     histogram_values=HISTOGRAM_VALUES))
                kept.append(name)
            except Exception as e:
                self._unmeasurable.add((what, name))
                self.failures.warn_once(
                    f"unmeasurable:{what}:{name}",
                    f"layerwatch: could not measure the {what} of {name!r} ({type(tensor).__name__}, {tensor.dtype}): "
                    f"{e!r}; they are left out from now on",
                )
        return kept, torch.cat(rows) if rows else torch.empty(0)


def parameters(model: Optional[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """The model's named parameters that hold values, under clean names (none when the model
    is gone); see :meth:`~layerwatch.distributed.sharding.Layout.parameters`."""
    return parameter_layout(model).parameters(model)


def update_ratios(names: Sequence[str], deltas: np.ndarray, after_norms: np.ndarray, weight_norms: dict[str, float]) -> np.ndarray:
    """‖Δw‖ / ‖w‖ of each parameter, ``w`` the weights after the step: 0 where the step did
    not change them, 1 where it set them to zero (never inf: a weight that was zero before the
    step, as BatchNorm biases and LoRA's B start, has a finite ratio). ‖w‖ comes from the
    weights' own rows where they were read (``weight_norms``, by name), else from the
    snapshot's ``after_norms`` (an estimate's: both norms of the same strided sample)."""
    norms = np.array([weight_norms.get(name, np.nan) for name in names]) if weight_norms else after_norms
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(deltas == 0, 0.0, np.where(norms == 0, 1.0, deltas / norms))
