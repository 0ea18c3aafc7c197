"""Which weights held NaN/Inf when a sampled step's forward began.

A module that computes with a non-finite weight makes a non-finite output from finite
inputs without having made the fault: the optimizer carried an earlier NaN into its
weights. It is never named as the first offender, whatever else is known (the sentinel
may be off, or may have checked another share of the gradients at the step of the fault);
the probes name it as the first module to *use* a non-finite weight instead.

The check is one fused norm per device and dtype over the weights as the step's hooks are
armed (before its forward), read on the host with the probe's own transfer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn

from layerwatch.distributed.sharding import clean_name, local_tensors
from layerwatch.stats.norms import fused_norms
from layerwatch.vocabulary import ROOT, parent


@dataclass
class NonfiniteWeights:
    """The parameters that held NaN/Inf at the step's start, and the modules computing with them."""

    names: list[str] = field(default_factory=list)  # as named_parameters() spells them, aliases included
    modules: set[str] = field(default_factory=set)  # probe names: each holder of one and every module above it


class WeightCheck:
    """The NaN/Inf check of ``parameters`` (this rank's parts) at the moment it is made."""

    def __init__(self, model: nn.Module, parameters: Sequence[nn.Parameter]) -> None:
        self._model = weakref.ref(model)
        self._parameters = list(parameters)
        groups = _checkable_norms([t.detach() for t in local_tensors(self._parameters)]) if self._parameters else []
        self._order = [i for indices, _ in groups for i in indices]  # the parameter of each norm, in order
        self._norms = [norms for _, norms in groups]

    @property
    def count(self) -> int:
        """How many parameters are checked."""
        return len(self._order)

    def pieces(self) -> list[torch.Tensor]:
        """The norms, one tensor per device, to bring to the host with the probe's other pieces."""
        return list(self._norms)

    def combine(self) -> None:
        """A parameter spread over ranks is non-finite when any rank's part is: one all_reduce
        per device, by every rank, once they agreed that each checks as many parameters."""
        import torch.distributed as dist

        by_device: dict[torch.device, list[int]] = {}
        for i, norms in enumerate(self._norms):
            by_device.setdefault(norms.device, []).append(i)
        for indices in by_device.values():
            bad = torch.cat([self._norms[i] for i in indices]).isfinite().logical_not().float()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            for i, part in zip(indices, bad.split([self._norms[i].numel() for i in indices])):
                self._norms[i] = torch.where(part > 0, torch.nan, self._norms[i])

    def seen(self, host: Sequence[np.ndarray]) -> NonfiniteWeights:
        """What the host copies of :meth:`pieces` say."""
        flat = np.concatenate(list(host)) if host else np.empty(0)
        bad_ids = {id(self._parameters[self._order[i]]) for i in np.flatnonzero(~np.isfinite(flat))}
        model = self._model()
        if not bad_ids or model is None:
            return NonfiniteWeights()
        found = NonfiniteWeights()
        for qualified, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in bad_ids:
                continue
            name = clean_name(qualified)
            found.names.append(name)
            module = parent(name)
            while module:
                found.modules.add(module)
                module = parent(module)
            found.modules.add(ROOT)
        return found


def _checkable_norms(tensors: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """:func:`~layerwatch.stats.norms.fused_norms` of ``tensors``; where that fails (a tensor
    subclass without reductions), of each tensor alone, leaving out those it fails for: they are
    not checked (the weights family says once that it cannot read them)."""
    try:
        return fused_norms(tensors)
    except Exception:
        checked = []
        for i, t in enumerate(tensors):
            try:
                ((_, norms),) = fused_norms([t])
            except Exception:
                continue
            checked.append(([i], norms))
        return checked
