"""The "structure" family's probe: hooks on every module that record its calls, shapes and
MACs for the layer table (:mod:`layerwatch.table.summary`). :func:`~layerwatch.table.summarize.summarize`
runs one forward under it; a sampled step arms it on the first forward it sees, so the
table comes from the real batch with no extra forward."""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from layerwatch.distributed.sharding import named_modules
from layerwatch.table.flops import extra_flop_formulas
from layerwatch.guards.hooks import detached, entered_by_its_own_hook, is_compiling, tensors_in
from layerwatch.table.summary import Layer, Summary, add_parameters, describe


class StructureProbe:
    """Hooks on every module that record calls, shapes and MACs; ``remove()`` is safe twice.

    A window opens when a module is entered with no module running and closes when it
    returns; FlopCounterMode's counting mode is active only inside windows. With ``training_only``
    windows opened with autograd off (validation) are ignored. Calls during backward
    (activation checkpointing recomputes) are never counted. A hook that fails records
    the error and the probe goes quiet; it never raises into the forward.
    """

    def __init__(self, model: nn.Module, *, training_only: bool) -> None:
        self.training_only = training_only
        modules = named_modules(model)  # wrappers (FSDP1, checkpointing, torch.compile's) left out, names clean
        self.layers = [Layer(name, type(m).__name__, name.count(".") + 1 if name else 0) for name, m in modules]
        self.model_type = self.layers[0].type if self.layers else type(model).__name__  # a wrapper's: its model's
        self._model = weakref.ref(model)
        self.error: Optional[BaseException] = None
        self.inert = False  # hooks kept on a model found running inside compiled code (probes.StepProbes)
        self.failed_in: Optional[str] = None
        self.windows = 0
        self.first_input: Optional[tuple[int, ...]] = None  # shape of the first tensor the model received
        self._stack: list[tuple[Layer, int, Any]] = []  # (layer, FLOPs at entry, error being handled at entry)
        self._ignored_depth = 0
        self._counter: Any = None
        self._counter_exit: Callable[..., Any] = lambda *_: None
        self._flex_restore: Optional[Callable[[], None]] = None
        self._handles: list[Any] = []
        for layer, (_, module) in zip(self.layers, modules):
            self._handles.append(module.register_forward_pre_hook(self._enter_hook(layer), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit_hook(layer), with_kwargs=True, always_call=True))

    def summary(self, flattened: Optional[Mapping[str, tuple[int, torch.dtype, bool]]] = None) -> Summary:
        """The table of what was recorded, with the parameters as they are now (``flattened``:
        FSDP1's record of those it flattened, see :func:`~layerwatch.table.summary.add_parameters`)."""
        model = self._model()
        if model is not None:
            add_parameters(model, self.layers, flattened)
        return Summary(self.model_type, self.layers, self.first_input)

    def uncounted(self, action: Callable[[], None]) -> None:
        """``action()`` with the open window's FLOP counter off: layerwatch's own work inside the
        forward (a re-run's transformer signals) is not the model's."""
        mode = None if self._counter is None else getattr(self._counter, "mode", self._counter)
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
        except ImportError:  # an older torch
            action()
            return
        if mode is not None and _get_current_dispatch_mode() is mode:
            with _pop_mode_temporarily():
                action()
        else:
            action()

    def keep_inert(self) -> None:
        """Leave the hooks on the model, doing nothing, until :meth:`remove` (the model runs
        inside compiled code, which was compiled with them: see StepProbes)."""
        self.inert = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []
        self._ignored_depth = 0
        self._close_counter()

    # Hooks hold the layer record, never the module or the inspector.
    def _enter_hook(self, layer: Layer) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not is_compiling() and self.error is None and not self.inert:  # traced by Dynamo: nothing
                try:
                    self._enter(layer, args, kwargs)
                except Exception as e:  # a probe must never break the forward
                    self._fail(e)

        return hook

    def _exit_hook(self, layer: Layer) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not is_compiling() and self.error is None and not self.inert:
                try:
                    self._exit(layer, output)
                except Exception as e:
                    self._fail(e)

        return hook

    def _enter(self, layer: Layer, args: tuple, kwargs: dict) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute inside backward
        if self._ignored_depth or (not self._stack and self.training_only and not torch.is_grad_enabled()):
            self._ignored_depth += 1  # a call outside training (validation): not recorded
            return
        if not self._stack:
            self._open_counter()
            if self.first_input is None:
                first = next(tensors_in((args, kwargs)), None)
                self.first_input = None if first is None else describe(first)[0]
        if layer.calls == 0 and not self._running(layer):
            layer.inputs = [describe(t) for t in tensors_in((args, kwargs))]
        self._stack.append((layer, self._counter.get_total_flops(), sys.exc_info()[1]))

    def _exit(self, layer: Layer, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        if self._ignored_depth:
            self._ignored_depth -= 1
            return
        if not entered_by_its_own_hook(self._stack[-1][0] if self._stack else None, layer):
            return
        entered, flops_at_entry, error_at_entry = self._stack.pop()
        if entered is not layer:
            raise RuntimeError(f"module calls out of order: left {layer.name!r} while in {entered.name!r}")
        error = sys.exc_info()[1]
        if error is not None and error is not error_at_entry and self.failed_in is None:
            self.failed_in = layer.name or self.model_type  # the innermost module sees the error first
        outputs = [describe(t) for t in tensors_in(output)]
        if layer.calls == 0:
            layer.outputs = outputs
        layer.all_outputs += outputs
        layer.calls += 1
        if not self._running(layer):  # a recursive call is counted in the outer one
            layer.flops += self._counter.get_total_flops() - flops_at_entry
        if not self._stack:
            self._close_counter()
            self.windows += 1

    def _running(self, layer: Layer) -> bool:
        return any(entry[0] is layer for entry in self._stack)

    def _fail(self, error: Exception) -> None:
        self.error = detached(error)
        self._stack = []
        self._ignored_depth = 0
        self._close_counter()

    def _open_counter(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False, custom_mapping=extra_flop_formulas())
        try:  # its dispatch mode alone, every FLOP counted as the model's ("Global"); not its ModTracker, whose
            # module and gradient hooks would give per-module counts not read here, and which fail under FlexAttention
            counter.flop_counts.clear()
            counter.mode = _counting_mode()(counter)
            counter.mode.__enter__()
            self._counter_exit = counter.mode.__exit__
        except ImportError:  # an older torch
            counter.__enter__()
            self._counter_exit = counter.__exit__
        self._counter = counter
        self._flex_restore = flex_compiles_outside(getattr(counter, "mode", counter))  # before 2.4: the mode itself

    def _close_counter(self) -> None:
        counter, self._counter = self._counter, None
        restore, self._flex_restore = self._flex_restore, None
        if restore is not None:
            restore()
        if counter is not None:
            self._counter_exit(None, None, None)


@functools.cache
def _counting_mode() -> type:
    """torch's FLOP counting dispatch mode, told to stand aside while ``torch.compile`` compiles
    (``ignore_compile_internals``, torch 2.8 and later): a compiled function an eager model calls
    (``torch.compile(flex_attention)``, a compiled helper), first called inside a table's window,
    would otherwise be skipped by Dynamo for good ("non-infra torch dispatch mode present") and run
    eagerly ever after. Its compiled kernels' FLOPs are not counted.

    Raises:
        ImportError: a torch without it (the caller falls back to the whole ``FlopCounterMode``).
    """
    from torch.utils.flop_counter import _FlopCounterMode

    class CountingMode(_FlopCounterMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

    return CountingMode


def flex_compiles_outside(mode: Any) -> Callable[[], None]:
    """FlexAttention's calls, while ``mode`` (a window's FLOP counter) is the innermost dispatch
    mode, compile and run with it off; returns what puts torch's function back. Dynamo compiles
    nothing under a dispatch mode, and FlexAttention run eagerly fails in torch 2.13 (as
    ``with FlopCounterMode(): flex_attention(q, k, v)`` alone does): ``flex_attention`` enters
    its module's ``setup_compilation_env``, looked up at each call, around its compiled call,
    and a stand-in for it takes the mode off there. Those calls' FLOPs are not counted."""
    try:
        flex = importlib.import_module("torch.nn.attention.flex_attention")
        setup = flex.setup_compilation_env
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
    except (ImportError, AttributeError):
        return lambda: None

    @contextlib.contextmanager
    def setup_compilation_env(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with contextlib.ExitStack() as stack:
            if _get_current_dispatch_mode() is mode:
                stack.enter_context(_pop_mode_temporarily())
            yield stack.enter_context(setup(*args, **kwargs))

    flex.setup_compilation_env = setup_compilation_env

    def restore() -> None:
        if flex.setup_compilation_env is setup_compilation_env:
            flex.setup_compilation_env = setup
    return restore
