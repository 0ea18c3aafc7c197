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
from layerwatch.distributed import Layout, NamedTensors, RankSync, fingerprint, local_tensors, norms, parameter_layout, this_ranks_groups
from layerwatch.failures import FailurePolicy
from layerwatch.options import Options

HISTOGRAM_VALUES = S.HISTOGRAM_VALUES

Piece = tuple[list[str], torch.Tensor]  # names, and their packed rows on one device


@dataclass
class Snapshot:
    """The trainable weights just before the optimizer step."""

    groups: list[tuple[Any, list[str], list[torch.Tensor]]]


class ParameterFamilies:
    """Reads the weights, gradients and updates of the parameters this rank measures.

    Sharded parameters are reduced by every rank of their group together. Before each such
    reduction the ranks check that they hold the same list of tensors (``sync``): where they
    do not, every rank skips it, so no rank is left waiting in a collective the others will
    not issue.
    """

    def __init__(self, options: Options, failures: FailurePolicy) -> None:
        self.options = options
        self.failures = failures
        self.workspace = S.Workspace()
        self.layout = Layout()  # how the parameters lie over the ranks (set by the engine at start)
        self.sync: Optional[RankSync] = None  # where the ranks of a sharded run agree
        self._unmeasurable: set[tuple[str, str]] = set()  # (weights|gradients, name) whose statistics failed

    def release(self) -> None:
        self.workspace.clear()

    def gradients(self, params: Sequence[tuple[str, nn.Parameter]], step: int) -> list[Piece]:
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

    def weights(self, params: NamedTensors) -> list[Piece]:
        return self.reduce(params, "weights")

    def snapshot(self, params: Sequence[tuple[str, nn.Parameter]], slot: str = "snapshot") -> Snapshot:
        """Copies of the trainable weights, in workspace buffers named ``slot`` + a number
        (several snapshots alive at once need different slots). Never raises: a group that
        cannot be copied is left out (plain tensors) or kept without copies (sharded ones,
        whose update norms every rank still reduces: they read as failed)."""
        groups = []
        with torch.no_grad():
            trainable = [(n, p) for n, p in params if p.requires_grad]
            for i, (group, names, tensors) in enumerate(self._groups(trainable, "snapshot")):
                try:
                    groups.append((group, names, self._copies(tensors, f"{slot}{i}")))
                except Exception as e:
                    self.failures.warn_once("fail:snapshot", f"layerwatch: could not snapshot weights for update ratios: {e!r}; skipped")
                    if group is not None:
                        groups.append((group, names, None))
        return Snapshot(groups)

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

    def updates(self, snapshot: Snapshot, params: Sequence[tuple[str, nn.Parameter]], weight_norms: bool) -> list[Piece]:
        """Rows ``[‖Δw‖, ‖w‖]`` of each snapshotted parameter (two rows per piece), ``w`` after
        the step; ``‖w‖`` is NaN unless ``weight_norms`` (the weights' own rows hold it)."""
        current = dict(params)
        pieces = []
        with torch.no_grad():
            for group, names, before in snapshot.groups:
                after = local_tensors([current[name] for name in names])
                if before is not None:
                    torch._foreach_sub_(before, after)
                deltas = norms(before, group, len(names), after[0].device)
                after_norms = norms(after, group) if weight_norms else torch.full_like(deltas, float("nan"))
                pieces.append((names, torch.stack([deltas, after_norms])))
        self._release_snapshots()
        return pieces

    def reduce(self, pairs: NamedTensors, what: str) -> list[Piece]:
        """Rows of ``what`` ("weights" or "gradients") of the named tensors this rank reduces."""
        options, pieces = self.options, []
        measurable = [(name, t) for name, t in pairs if (what, name) not in self._unmeasurable]
        for group, names, tensors in self._groups(measurable, what):
            if group is not None:  # collective: every rank must take part in step with the others
                pieces.append((names, S.reduce_sharded(tensors, group, options.bins, zeros=options.zeros,
                                                       centered=options.centered, histogram_values=HISTOGRAM_VALUES)))
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

    def _groups(self, pairs: NamedTensors, what: str) -> list[tuple[Any, list[str], list[torch.Tensor]]]:
        """:func:`~layerwatch.distributed.this_ranks_groups`, less the sharded groups whose
        tensors are not the same on every rank (said once; every rank leaves them out alike)."""
        if self.sync is None:
            return this_ranks_groups(pairs, self.failures.warn_once, self.layout)
        try:
            groups, error = this_ranks_groups(pairs, self.failures.warn_once, self.layout), None
        except Exception as e:  # this rank still says so to the others, who wait for it
            groups, error = [], e
        sharded = [names for group, names, _ in groups if group is not None]
        every = [name for names in sharded for name in names]
        agreed = self.sync.same([int(error is not None), len(sharded), len(every), fingerprint(every)])
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
    is gone); see :meth:`~layerwatch.distributed.Layout.parameters`."""
    return parameter_layout(model).parameters(model)
