"""The layer table of a compiled model, from the shapes of its inputs alone.

Module hooks do not run inside compiled code, so the hooks that record the layer table
(:class:`~layerwatch.probes.structure.StructureProbe`) cannot ride along with a compiled
model's training forward. The table needs shapes, not values: on the first sampled step,
:class:`InputShapes` notes what each training forward of the model was given, as fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shape, dtype, device and strides, no
storage; the batch itself is not kept), and after the step :meth:`InputShapes.forward` runs the
model once more on them, compiled code eager, under that fake tensor mode. Each operator then
computes only the metadata of its result: no kernel runs, no memory is taken, and
``FlopCounterMode`` counts the MACs from the shapes as it does on real tensors.

Where the inputs are noted: the model's call must run eagerly around its compiled code. A
``torch.compile(model)`` wrapper runs its own hooks eagerly, and so does a model with compiled
parts: a forward pre-hook on it notes them. ``module.compile()`` compiles the model's whole
call, its hooks included (a hook there would become frames of its own): its compiled call is
wrapped instead, as an instance attribute, for the step. A model called from compiled code
(``torch.compile`` of a function that calls it) runs nowhere eagerly: nothing is noted.

What that forward may change is put back after it (:class:`~layerwatch.replay.SavedState`): the
RNG states (a fake random op draws nothing, but the model's own Python code may), the buffers
(an in-place op on a one-element buffer, such as BatchNorm's ``num_batches_tracked``, writes the
real tensor even under fake tensors) and the modules' modes; a fake tensor it left on a module
(a cache kept as an attribute) is taken off again.

:class:`CompiledTable` is the engine's side of it: note the shapes on the first sampled step,
make the table after it, and say once when that cannot be.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from layerwatch.distributed import world_size
from layerwatch.failures import FailurePolicy
from layerwatch.hooks import detached, is_compiling, tensors_in
from layerwatch.replay import SavedState, run_eagerly


@dataclass
class FakeCall:
    """One training forward of the model: its arguments, fake tensors in place of the real
    ones, and the autocast it ran under (device type, dtype)."""

    args: tuple
    kwargs: dict[str, Any]
    autocast: list[tuple[str, torch.dtype]]


class InputShapes:
    """The inputs of the model's training forwards in one step, as fake tensors, from the time
    it is made until :meth:`remove` (safe twice). A forward that starts with autograd off
    (validation) or inside backward (a recompute) is not noted."""

    def __init__(self, model: nn.Module) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.calls: list[FakeCall] = []
        self.error: Optional[BaseException] = None
        self._model = weakref.ref(model)
        self._handle: Any = None
        self._wrapper: Optional[weakref.ref] = None
        compiled_call = model.__dict__.get("_compiled_call_impl")
        if compiled_call is None:
            self._handle = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True)
            return

        def call(*args: Any, **kwargs: Any) -> Any:
            self._note(args, kwargs)
            return compiled_call(*args, **kwargs)

        call.layerwatch_previous = compiled_call  # type: ignore[attr-defined]
        self._wrapper = weakref.ref(call)
        model._compiled_call_impl = call

    def remove(self) -> None:
        """Stop noting; what was noted stays."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        model, wrapper = self._model(), self._wrapper() if self._wrapper is not None else None
        self._wrapper = None
        if model is not None and wrapper is not None and model.__dict__.get("_compiled_call_impl") is wrapper:
            model._compiled_call_impl = wrapper.layerwatch_previous  # unless compiled again since: theirs stays

    def forward(self, model: nn.Module) -> None:
        """Run ``model`` on each noted call's fake inputs, compiled code eager, with autograd on
        and the autocast that call had; whatever it changed is put back after.

        Raises:
            Exception: what the forward raised (a value read on the host, say).
        """
        saved = SavedState(model, copy_gradients=False)
        attributes = [(module, dict(module.__dict__), dict(module._buffers)) for module in model.modules()]
        try:
            with run_eagerly(), self.mode, torch.enable_grad():
                for call in self.calls:
                    with contextlib.ExitStack() as stack:
                        for device_type, dtype in call.autocast:
                            stack.enter_context(torch.autocast(device_type, dtype=dtype))
                        model(*call.args, **call.kwargs)
        finally:
            _take_off_fakes(attributes)
            saved.restore()

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self._note(args, kwargs)

    def _note(self, args: tuple, kwargs: dict[str, Any]) -> None:
        if is_compiling() or self.error is not None or not torch.is_grad_enabled() \
                or torch._C._current_graph_task_id() != -1:
            return
        try:
            self.calls.append(self._fake_call(args, kwargs))
        except Exception as e:  # noting must never break the forward
            self.error, self.calls = detached(e), []

    def _fake_call(self, args: tuple, kwargs: dict[str, Any]) -> FakeCall:
        from torch.utils import _pytree as pytree

        def fake(tensor: torch.Tensor) -> torch.Tensor:
            return self.mode.from_tensor(tensor, static_shapes=True)

        args, kwargs = pytree.tree_map_only(torch.Tensor, fake, (args, kwargs))
        leaves = pytree.tree_leaves((args, kwargs))
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) and next(tensors_in(leaf), None) is not None:
                raise TypeError(f"the model's inputs hold tensors in a {type(leaf).__name__}, which layerwatch cannot "
                                "copy as shapes")
        devices = {leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor)} | {"cpu", "cuda"}
        autocast = [(device_type, torch.get_autocast_dtype(device_type)) for device_type in sorted(devices)
                    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)]
        return FakeCall(args, kwargs, autocast)


class CompiledTable:
    """The layer table of a compiled model from the input shapes of its first sampled step:
    :meth:`note` them while it runs, :meth:`from_shapes` after it. Tried until a forward under
    fake tensors fails, then no more (said once)."""

    def __init__(self, failures: FailurePolicy) -> None:
        self.failures = failures
        self._shapes: Optional[InputShapes] = None  # the inputs of the step's training forwards, as fake tensors
        self._from_shapes = True  # until a forward under fake tensors failed

    def note(self, model: nn.Module, step: int) -> None:
        """Note the inputs of this step's training forwards (in a single-process run)."""
        if self._from_shapes and world_size() == 1:
            self.failures.run("note the input shapes for the layer table", lambda: self._note(model), step)

    def _note(self, model: nn.Module) -> None:
        self.unhook()  # a step dropped before its end
        # Before torch 2.6 (no set_stance) compiled code cannot run eagerly: it would compile on the fake inputs.
        self._shapes = InputShapes(model) if hasattr(torch.compiler, "set_stance") else None

    def unhook(self) -> None:
        """Note no more (what was noted stays, for :meth:`from_shapes`)."""
        if self._shapes is not None:
            self._shapes.remove()

    def forget(self) -> None:
        self._shapes = None

    def from_shapes(self, record: Callable[[Callable[[], None]], Any], model: nn.Module) -> tuple[Any, bool]:
        """The table ``record(forward)`` makes while ``forward()`` runs the model on the noted
        shapes, and whether that failed (said once). (None, False): nothing was noted."""
        shapes, self._shapes = self._shapes, None
        if shapes is None:
            return None, False
        shapes.remove()
        try:
            if shapes.error is not None:
                raise shapes.error
            if not shapes.calls:
                return None, False
            return record(lambda: shapes.forward(model)), False
        except Exception as e:
            self._from_shapes = False
            self.failures.warn_once(
                "table-shapes",
                f"layerwatch: could not record the layer table of the compiled model from its input shapes under fake "
                f"tensors ({e!r}; a forward that reads a value on the host, branches on one, or calls an operator with no "
                "fake implementation does not run there). Where layerwatch can run the step's batch again (Lightning's "
                "callback, Inspector.replay_with), the table comes from one eager forward of it; else call "
                "layerwatch.summarize(model._orig_mod, batch).",
            )
            return None, True


def _take_off_fakes(attributes: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]) -> None:
    """Put back each module attribute and buffer that the forward left as a fake tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    for module, before, buffers in attributes:
        for now, then in ((module.__dict__, before), (module._buffers, buffers)):
            for key in [key for key, value in now.items() if isinstance(value, FakeTensor)]:
                if key in then:
                    now[key] = then[key]
                else:
                    del now[key]
