"""The runtime probe's gradient hooks: a tensor hook per module call, told when the call's
backward starts and when it is done, and the model's parameters' gradients read when its
backward pass ends."""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch
from torch import nn

from layerwatch.distributed.sharding import walk


class BackwardListener(Protocol):
    """What a :class:`GradientHook` tells (the runtime probe)."""

    def backward_starts(self, call: int, grad: torch.Tensor) -> None: ...

    def backward_done(self, call: int, grads: Sequence[Optional[torch.Tensor]]) -> None: ...


class GradientHook:
    """A tensor hook for one call: its backward starts (``done`` False: called with the gradient
    of one of its outputs) or is done (called with the gradients of its inputs, or with one
    of them). One object holding the probe and the call's number: a ``functools.partial``
    of a bound method is three, for the garbage collector to walk."""

    __slots__ = ("probe", "call", "done")

    def __init__(self, probe: BackwardListener, call: int, done: bool) -> None:
        self.probe, self.call, self.done = probe, call, done

    def __call__(self, grad: Any) -> None:
        if not self.done:
            self.probe.backward_starts(self.call, grad)
        else:
            self.probe.backward_done(self.call, (grad,) if grad is None or isinstance(grad, torch.Tensor) else grad)


def gradients_of(model: nn.Module) -> list[Optional[torch.Tensor]]:
    """The gradients of ``model``'s parameters that require one, read from each module's own
    (a parameter two modules hold comes twice: its NaN flag is the same): no generator resumed
    per parameter, as ``model.parameters()`` is."""
    return [p.grad for _, m in walk(model) for p in m._parameters.values() if p is not None and p.requires_grad]


def on_gradients(tensors: list[torch.Tensor], probe: BackwardListener, call: int, done: bool) -> Any:
    """A :class:`GradientHook` on ``tensors``: a multi-grad hook (any of them for a start, all
    of them for a done); for one tensor (most modules) its plain tensor hook, which fires at
    the same moment and allocates a tenth of the objects."""
    hook = GradientHook(probe, call, done)
    if len(tensors) > 1:
        return torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="all" if done else "any")
    return tensors[0].register_hook(hook)
