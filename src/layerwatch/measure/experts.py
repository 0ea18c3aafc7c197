"""One row per expert of each fused expert parameter: ``<param>[e]`` in the weights' and gradients'
norms and the update ratios, besides the whole tensor's rows (the ``moe`` family with the weights,
grads or updates family).

A Mixture-of-Experts layer's experts module (:func:`~layerwatch.probes.routers.expert_modules`)
holds its experts fused: a parameter of it with two dims or more whose first is its number of
experts ``E`` holds expert ``e``'s weights in ``p[e]`` (Mixtral's ``gate_up_proj [E, 2I, H]``,
gpt-oss's ``gate_up_proj_bias [E, 2I]``). Its slices are read from the tensor as it is: views
``p.unbind(0)`` (one call per parameter, no copy) whose norms only are computed, in one fused
kernel (:func:`~layerwatch.distributed.sharding.norms`, the update snapshot's too): the norm is
all that is written of a slice. Which tensors of a list are
fused, and their rows' names, are worked out once per list of names (:class:`_Plan`), so a sampled
step does no Python work per expert.

**Sharded.** A DTensor sharded along dim 0 (FSDP2's ``fully_shard``) holds whole experts on each
rank, ``offset`` to ``offset + k - 1``: the others are empty pieces there, so every rank reduces
``E`` pieces per parameter and each expert's sums combine over the ranks as any sharded tensor's
do. Sharded along another dim (tensor parallel), each rank holds a piece of every expert. FSDP1's
flat parameters and DeepSpeed ZeRO's partitions hold flattened pieces whose experts are not
views: their per-expert rows are left out, said once (:func:`find_splits`). Estimated update
ratios (a strided sample of each weight) have no per-expert rows either.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from layerwatch.distributed.agreement import fingerprint
from layerwatch.distributed.sharding import Layout, is_dtensor, is_writer_rank, norms
from layerwatch.probes.routers import RouterSpec, expert_modules
from layerwatch.vocabulary import ROOT, expert_param_name

Piece = tuple[list[str], torch.Tensor]  # names, and their packed rows on one device (as measure/params.py's)


class Split(NamedTuple):
    """How a fused expert parameter is split: its ``experts``, and the first of them this rank's
    local tensor holds (``offset``: 0 but for a DTensor sharded along dim 0; None: unknown, this
    rank's pieces then read as failed)."""

    experts: int
    offset: Optional[int]


class _Plan(NamedTuple):
    """The fused expert parameters among a list of tensors: their positions, splits and rows' names."""

    picked: list[int]
    splits: list[Split]
    names: list[str]  # ``<param>[e]``, E a parameter


def find_splits(model: nn.Module, specs: Optional[Sequence[RouterSpec]], layout: Layout, zero: Any,
                say_once: Callable[[str, str], None]) -> dict[str, Split]:
    """The fused expert parameters of ``model`` by clean name, with their :class:`Split` on this
    rank. Those held as FSDP1 flat parameters or DeepSpeed ZeRO partitions are left out, said once
    with ``say_once``."""
    found: dict[str, Split] = {}
    flattened = []
    for module_name, module, experts in expert_modules(model, specs):
        base = "" if module_name == ROOT else module_name + "."
        for local_name, p in module._parameters.items():
            name = base + local_name
            if zero is not None or name in layout.pieces or name in layout.flattened:
                flattened.append(name)
            elif p is not None and p.dim() >= 2 and p.shape[0] == experts:
                found[name] = Split(experts, _offset(p))
        flattened += [name for name in layout.flattened if name.startswith(base) and "." not in name[len(base):]
                      and name not in flattened]  # FSDP1 with use_orig_params=False: not on the module at all
    if flattened and is_writer_rank():
        holder = "DeepSpeed ZeRO's partitions" if zero is not None else "FSDP1's flat parameters"
        say_once("flat-experts", f"layerwatch: {holder} hold the fused expert parameters flattened "
                 f"({', '.join(flattened[:3])}{' ...' if len(flattened) > 3 else ''}), so their experts' slices are not "
                 "read: no per-expert rows <param>[e] (the whole tensors' rows go on)")
    return found


def _offset(p: torch.Tensor) -> Optional[int]:
    """The first expert this rank's part of ``p`` holds: 0 but for a DTensor sharded along dim 0."""
    if not is_dtensor(p):
        return 0
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return int(offset[0]) if shape[0] else 0  # holding no expert: every piece empty (see _slices)
    except Exception:
        return None


def _slices(t: torch.Tensor, split: Split) -> list[torch.Tensor]:
    """``split.experts`` pieces of ``t`` (this rank's part of a fused expert parameter), expert by
    expert: views of its rows, and an empty piece for each expert it does not hold."""
    if split.offset is None:
        raise ValueError("this rank's experts of the parameter are unknown")
    pieces = list(t.unbind(0))
    after = split.experts - split.offset - len(pieces)
    if after == 0 and split.offset == 0:
        return pieces
    if after < 0:
        raise ValueError(f"{len(pieces)} experts from expert {split.offset} of {split.experts}")
    empty = t[:0]
    return [empty] * split.offset + pieces + [empty] * after


class ExpertRows:
    """The per-expert rows of the fused expert parameters among a family's groups of tensors
    (``splits``: by name, from :func:`find_splits`; empty: none, or the ``moe`` family off)."""

    PLANS = 16  # the plans of the lists of names seen last (by device, sharded groups, optimizers)

    def __init__(self) -> None:
        self.splits: dict[str, Split] = {}
        self.fingerprint = 0  # of the splits' names and sizes: what the ranks of a sharded run agree on besides
        self._plans: dict[tuple[str, ...], Optional[_Plan]] = {}

    def start(self, splits: dict[str, Split]) -> None:
        self.splits, self._plans = splits, {}
        self.fingerprint = fingerprint([f"{name}[{split.experts}]" for name, split in splits.items()]) if splits else 0

    def plan(self, names: Sequence[str]) -> Optional[_Plan]:
        """The :class:`_Plan` of a list of names, made the first time; None: no fused expert parameter."""
        key = tuple(names)
        if key in self._plans:
            return self._plans[key]
        picked = [i for i, name in enumerate(names) if name in self.splits]
        splits = [self.splits[names[i]] for i in picked]
        plan = _Plan(picked, splits, [expert_param_name(names[i], e) for i, split in zip(picked, splits)
                                      for e in range(split.experts)]) if picked else None
        if len(self._plans) >= self.PLANS:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    @staticmethod
    def slices(plan: _Plan, tensors: Sequence[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        """The pieces of the plan's tensors among ``tensors``, expert by expert (None: this rank cannot slice them)."""
        try:
            with torch.no_grad():
                return list(itertools.chain.from_iterable(map(_slices, [tensors[i] for i in plan.picked], plan.splits)))
        except Exception:
            return None

    def reduce(self, group: Any, names: list[str], tensors: list[torch.Tensor]) -> Optional[Piece]:
        """The L2 norms of the experts' slices among a group's tensors, one row of columns
        (float64; ``group``: their ranks' process group, None: this rank's own, on one device).
        Only the norm is written of a slice, so only it is computed: one fused kernel over the
        views, no copy, where the whole tensors' reduction copies and sorts into buckets. A rank
        that cannot slice its pieces of a sharded group still takes part: every rank's norms
        then read as failed."""
        plan = self.plan(names)
        if plan is None:
            return None
        pieces = self.slices(plan, tensors)
        if group is None and pieces is None:
            raise ValueError(f"could not slice the experts of {names[plan.picked[0]]!r}")
        with torch.no_grad():
            return plan.names, norms(pieces, group, len(plan.names), tensors[0].device)[None]

    def update_norms(self, group: Any, names: list[str], deltas: Optional[list[torch.Tensor]], after: list[torch.Tensor],
                     after_norms: bool) -> Optional[Piece]:
        """Rows ``[‖Δw_e‖, ‖w_e‖]`` of the experts among a snapshot group's tensors, from their
        differences ``deltas`` (None: this rank could not snapshot them) and the weights ``after``
        the step; ``‖w_e‖`` NaN unless ``after_norms``. Every rank of a sharded group takes part."""
        plan = self.plan(names)
        if plan is None:
            return None
        n, device = len(plan.names), after[0].device
        delta_pieces = None if deltas is None else self.slices(plan, deltas)
        after_pieces = self.slices(plan, after) if after_norms else None
        if group is None and (delta_pieces is None or (after_norms and after_pieces is None)):
            raise ValueError(f"could not slice the experts of {names[plan.picked[0]]!r}")
        with torch.no_grad():
            delta_norms = norms(delta_pieces, group, n, device)
            weight_norms = norms(after_pieces, group, n, device) if after_norms else torch.full_like(delta_norms, float("nan"))
        return plan.names, torch.stack([delta_norms, weight_norms])
