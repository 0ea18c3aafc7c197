"""The replay: a step's batch run again, forward and backward, with every probe armed, before
the optimizer applies the step, leaving no trace.

A front door hands the engine each micro-batch of the open step as a closure that computes its
loss again (:meth:`~layerwatch.engine.engine.Engine.replay_with`), before that micro-batch's forward;
the engine notes the RNG state it starts from (:class:`MicroBatch`). When the NaN sentinel
finds non-finite gradients at that step, still before the optimizer step, the engine runs
those micro-batches again in order (:func:`replay_until_named`), each from its own RNG state
(the same dropout masks) and with fresh gradients, until one shows the first module that made
a NaN or Inf. A compiled model's sampled step is run again too, forward only
(:mod:`~layerwatch.engine.rerun`), with the same care.

What a replay leaves as it found it (:class:`SavedState`):

* the RNG states: torch's CPU generator and CUDA generators, Python's and NumPy's;
* the buffers (BatchNorm running statistics): the tensors the modules hold, and their values;
* each module's attributes (a counter or a cache a forward sets, which compiled code may be
  guarded on), and its mode (``training``);
* the gradients: the tensors the parameters hold (the model's, and those of the optimizers
  it was given, which a closure may reach beyond the model), and in a distributed run their
  values too (DDP's ``gradient_as_bucket_view`` gradients share storage with what a
  synchronized backward writes);
* DDP's sync flags (:func:`gradient_sync_off`).

Compiled code runs eagerly during a replay (:func:`run_eagerly`), so a compiled model is
replayed with every probe too.

The optimizer then steps as it would have without layerwatch.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from layerwatch.probes import ProbeResult, StepProbes


@dataclass
class RngState:
    """torch's default CPU generator and, once CUDA is in use, every CUDA generator."""

    cpu: torch.Tensor
    cuda: Optional[list[torch.Tensor]]

    @classmethod
    def capture(cls) -> "RngState":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class MicroBatch:
    """One micro-batch of the open step: a closure that computes its loss again, and the RNG
    state its forward began from."""

    closure: Callable[[], Any]
    rng: RngState


class SavedState:
    """What a replay may change, saved before it; :meth:`restore` puts it back."""

    def __init__(self, model: nn.Module, copy_gradients: bool, also: Iterable[torch.Tensor] = ()) -> None:
        self.rng = RngState.capture()
        self.python_rng = random.getstate()
        self.numpy_rng = np.random.get_state()
        self.attributes = [(module, dict(module.__dict__)) for module in model.modules()]  # modes among them
        self.buffers = [
            (module, name, buffer, buffer.detach().clone())
            for module in model.modules() for name, buffer in module._buffers.items() if buffer is not None
        ]
        params = [p for p in dict.fromkeys([*model.parameters(), *also]) if p.requires_grad]
        self.gradients = [
            (p, p.grad, p.grad.detach().clone() if copy_gradients and p.grad is not None else None) for p in params
        ]

    def clear_gradients(self) -> None:
        """Fresh gradients for a replayed backward: the saved ones are not accumulated into."""
        for p, _, _ in self.gradients:
            p.grad = None

    def restore(self) -> None:
        with torch.no_grad():
            for module, name, buffer, value in self.buffers:
                module._buffers[name] = buffer
                buffer.copy_(value)
            for p, grad, value in self.gradients:
                p.grad = grad
                if value is not None:
                    grad.copy_(value)
        for module, before in self.attributes:
            now = module.__dict__
            if len(now) != len(before) or any(now.get(key, _GONE) is not value for key, value in before.items()):
                for key in [key for key in now if key not in before]:
                    del now[key]
                now.update(before)
        self.rng.restore()
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)


_GONE = object()


def loss_of(output: Any) -> Optional[torch.Tensor]:
    """The loss a replay closure returned: a tensor, or the ``"loss"`` of a mapping (what a
    LightningModule's ``training_step`` may return); None when there is none."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return loss_of(output.get("loss"))
    return None


def run_closure(closure: Callable[[], Any]) -> None:
    """A replay closure, with autograd on (an optimizer's pre-hook may run without it), and the
    backward of the loss it returns.

    Raises:
        TypeError: it returned no loss tensor that needs a gradient.
    """
    with torch.enable_grad():
        output = closure()
        loss = loss_of(output)
        if loss is None or not loss.requires_grad:
            raise TypeError(
                "the replay closure must return the loss (a tensor that requires grad, or a dict with a 'loss'), got "
                f"{type(output).__name__}" + ("" if loss is None else " that requires no gradient")
            )
        loss.backward()


def run_eagerly() -> contextlib.AbstractContextManager:
    """Inside: compiled code (a compiled model, ``model.compile()``, a compiled loss function)
    runs eagerly, so that the probes' module hooks see every module; no graph is made or
    thrown away (``torch.compiler.set_stance("force_eager")``, torch 2.6 and later)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return contextlib.nullcontext() if set_stance is None else set_stance("force_eager")


SYNC_FLAGS = ("require_backward_grad_sync", "require_forward_param_sync")


@contextlib.contextmanager
def gradient_sync_off(*models: Optional[nn.Module], buffers: bool = False) -> Iterator[None]:
    """Inside: no ``DistributedDataParallel`` among ``models`` (and their submodules) reduces
    gradients, nor, with ``buffers``, broadcasts its buffers at a forward (a forward that one rank
    runs alone). Its sync flags are put back after, both of them: a forward under ``no_sync()``
    also turns off the buffer broadcast of the next forward."""
    from torch.nn.parallel import DistributedDataParallel

    found = {id(m): m for model in models if model is not None for m in model.modules()
             if isinstance(m, DistributedDataParallel)}
    flags = [(m, name, getattr(m, name)) for m in found.values() for name in SYNC_FLAGS if hasattr(m, name)]
    for module in found.values():
        module.require_backward_grad_sync = False
        if buffers:
            module.require_forward_param_sync = False
    try:
        yield
    finally:
        for module, name, value in flags:
            setattr(module, name, value)


_replaying = contextvars.ContextVar("layerwatch_replaying", default=False)


def replaying() -> bool:
    """Whether a replay is running its micro-batches again now (its forwards are not the step's)."""
    return _replaying.get()


def replay_until_named(model: nn.Module, micro_batches: Sequence[MicroBatch], probes: "StepProbes", step: int, *,
                       writer: bool, params: Sequence[nn.Parameter], within: Optional[nn.Module],
                       also: Iterable[torch.Tensor], copy_gradients: bool,
                       only: Optional[int] = None) -> Optional[tuple[int, "ProbeResult"]]:
    """Run ``micro_batches`` again in order, each from its RNG state, with fresh gradients and
    ``probes`` armed, compiled code eager and DDP's gradient sync off, until one's probes name
    an offender: its index and their result (None: none did). ``only``: run that micro-batch
    alone, and return what its probes saw, an offender named or not. The state is put back
    after, whatever happened (``also``: parameters beyond ``model`` whose gradients a closure
    may reach)."""
    saved = SavedState(model, copy_gradients, also)
    token = _replaying.set(True)
    try:
        with gradient_sync_off(model, within), run_eagerly():
            for index, micro in enumerate(micro_batches):
                if only is not None and index != only:
                    continue
                saved.clear_gradients()
                micro.rng.restore()
                probes.arm(model, params, step, writer=writer, structure=False, eager=True)
                try:
                    run_closure(micro.closure)
                finally:
                    _, result = probes.take()
                if result is not None and (result.offender is not None or only is not None):
                    return index, result
        return None
    finally:
        _replaying.reset(token)
        saved.restore()
