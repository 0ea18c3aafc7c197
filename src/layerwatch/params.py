"""The parameter families: weights, gradients and update ratios, reduced where they live.

Every tensor of one device goes through one batched :func:`layerwatch.stats.reduce`; the
rows stay on the device until the step's single transfer. Histograms of a tensor above
``HISTOGRAM_VALUES`` values come from a strided sample of it (its statistics stay exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.distributed import NamedTensors, local_tensors, norms, this_ranks_groups
from layerwatch.failures import FailurePolicy
from layerwatch.options import Options

HISTOGRAM_VALUES = S.HISTOGRAM_VALUES

Piece = tuple[list[str], torch.Tensor]  # names, and their packed rows on one device


@dataclass
class Snapshot:
    """The trainable weights just before the optimizer step."""

    groups: list[tuple[Any, list[str], list[torch.Tensor]]]


class ParameterFamilies:
    """Reads the weights, gradients and updates of the parameters this rank measures."""

    def __init__(self, options: Options, failures: FailurePolicy) -> None:
        self.options = options
        self.failures = failures
        self.workspace = S.Workspace()
        self._unmeasurable: set[tuple[str, str]] = set()  # (weights|gradients, name) whose statistics failed

    def release(self) -> None:
        self.workspace.clear()

    def gradients(self, params: Sequence[tuple[str, nn.Parameter]], step: int) -> list[Piece]:
        pairs = []
        for name, p in params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                self.failures.warn_once(f"sparse:{name}", f"layerwatch: the gradient of {name!r} is sparse; it is not measured")
                continue
            pairs.append((name, p.grad))
        if not pairs and any(p.requires_grad for _, p in params):
            self.failures.warn_once(
                "no-grads",
                f"layerwatch: no gradients at sampled step {step}; call inspector.step() after "
                "optimizer.step() and before optimizer.zero_grad(), or pass optimizer=",
            )
        return self.reduce(pairs, "gradients")

    def weights(self, params: NamedTensors) -> list[Piece]:
        return self.reduce(params, "weights")

    def snapshot(self, params: Sequence[tuple[str, nn.Parameter]], slot: str = "snapshot") -> Snapshot:
        """Copies of the trainable weights, in workspace buffers named ``slot`` + a number
        (several snapshots alive at once need different slots)."""
        groups = []
        with torch.no_grad():
            trainable = [(n, p) for n, p in params if p.requires_grad]
            for i, (group, names, tensors) in enumerate(this_ranks_groups(trainable, self.failures.warn_once)):
                groups.append((group, names, self._copies(tensors, f"{slot}{i}")))
        return Snapshot(groups)

    def _copies(self, tensors: list[torch.Tensor], slot: str) -> list[torch.Tensor]:
        """Copies of ``tensors`` in one buffer of the workspace, kept for the next sample on the
        CPU (a fresh copy of a large weight costs a page fault per 4 KiB there); per-tensor
        clones when their dtypes differ."""
        dtype = tensors[0].dtype
        if any([t.dtype != dtype for t in tensors]):
            return [t.detach().clone() for t in tensors]
        sizes = [t.numel() for t in tensors]
        flat = self.workspace.get(tensors[0].device, dtype, sum(sizes), slot, exact=True)
        copies = [piece.view(t.shape) for piece, t in zip(flat.split(sizes), tensors)]
        torch._foreach_copy_(copies, tensors)  # under no_grad: nothing recorded, no detach needed
        return copies

    def _release_snapshots(self) -> None:
        """Give an accelerator's snapshot memory back (its caching allocator reuses it anyway)."""
        self.workspace.drop("snapshot", keep_cpu=True)

    def updates(self, snapshot: Snapshot, params: Sequence[tuple[str, nn.Parameter]], weight_norms: bool) -> list[Piece]:
        """Rows ``[‖Δw‖, ‖w‖]`` of each snapshotted parameter (two rows per piece), ``w`` after
        the step; ``‖w‖`` is NaN unless ``weight_norms`` (the weights' own rows hold it)."""
        current = dict(params)
        pieces = []
        with torch.no_grad():
            for group, names, before in snapshot.groups:
                after = local_tensors([current[name] for name in names])
                torch._foreach_sub_(before, after)
                deltas = norms(before, group)
                after_norms = norms(after, group) if weight_norms else torch.full_like(deltas, float("nan"))
                pieces.append((names, torch.stack([deltas, after_norms])))
        self._release_snapshots()
        return pieces

    def reduce(self, pairs: NamedTensors, what: str) -> list[Piece]:
        """Rows of ``what`` ("weights" or "gradients") of the named tensors this rank reduces."""
        options, pieces = self.options, []
        measurable = [(name, t) for name, t in pairs if (what, name) not in self._unmeasurable]
        for group, names, tensors in this_ranks_groups(measurable, self.failures.warn_once):
            if group is not None:  # collective: every rank must take part in step with the others
                pieces.append((names, S.reduce_sharded(tensors, group, options.bins, zeros=options.zeros)))
                continue
            try:
                rows = S.reduce(
                    tensors, options.bins, zeros=options.zeros, centered=options.centered,
                    histogram_values=HISTOGRAM_VALUES, workspace=self.workspace,
                )
                pieces.append((names, rows))
            except Exception:
                pieces.append(self._reduce_one_by_one(what, names, tensors))
        return [(names, rows) for names, rows in pieces if names]

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
    """The model's named parameters that hold values (none when the model is gone)."""
    if model is None:
        return []
    return [(name, p) for name, p in model.named_parameters() if p.numel() > 0]
