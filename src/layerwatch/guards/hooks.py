"""What an engine attaches to the user's objects, and the two rules that keep it harmless.

1. **Nothing outlives its engine.** The hooks on the model and the optimizers, and the
   writer an engine owns, are held by an :class:`Attachments` apart from the engine (no
   hook holds the engine itself), released once: at ``finish()``, when the engine is
   garbage-collected, or at interpreter exit (``weakref.finalize``). A model handed to a
   new engine is taken from the old one first (:func:`claim`), so a notebook cell run
   twice does not stack hooks.
2. **No hook body runs inside a Dynamo trace.** Every hook starts with
   :func:`is_compiling`: traced, it is a constant ``True`` and the hook returns before
   anything, so it adds no graph break, no recompile and no op to compiled code; compiled
   code then runs without it.

:func:`tensors_in` finds the tensors in what a hook is given (arguments, outputs).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import sys
import time
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

try:
    from torch.compiler import is_compiling
except ImportError:  # torch < 2.3
    from torch._dynamo import is_compiling  # type: ignore[no-redef]

__all__ = ["Attachments", "CollectorClock", "claim", "engine_step_hooks", "inlined_only", "is_compiling"]


def inlined_only(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, which Dynamo traces where compiled code calls it but never compiles as a
    frame of its own, nor anything it calls: run from a frame Dynamo skipped (a ``torch.nn``
    forward under ``module.compile()``), it runs eagerly instead of becoming graphs of its own.
    As is on a torch without frame strategies (before 2.6)."""
    try:  # (from torch._C: torch._dynamo.types is the same, but importing it imports all of Dynamo, 1 s)
        from torch._C._dynamo.eval_frame import _FrameAction as FrameAction
        from torch._C._dynamo.eval_frame import _FrameExecStrategy as FrameExecStrategy
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
    except ImportError:
        return function
    set_code_exec_strategy(function.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return function


class Attachments:
    """Hook handles and objects with a ``remove()`` (the probes, the step counter), and the
    sink to close; :meth:`release` removes and closes them all, and is safe twice."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.removables: list[Any] = []
        self.sink: Any = None

    def hold(self, *removables: Any) -> None:
        """Objects with a ``remove()``, removed at :meth:`release`."""
        self.removables.extend(removables)

    def hold_handles(self, handles: Sequence[Any]) -> None:
        """Hook handles, removed at :meth:`release`."""
        self.handles.extend(handles)

    def use_sink(self, sink: Any) -> None:
        """The sink closed at :meth:`release` (None: no sink, nothing written)."""
        self.sink = sink

    def remove_hooks(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()
        for removable in self.removables:
            removable.remove()

    def release(self) -> None:
        """Remove every hook and close the sink; nothing raises (this runs from the collector
        and at interpreter exit, where an exception would only be printed)."""
        try:
            self.remove_hooks()
        finally:
            sink, self.sink = self.sink, None
            if sink is not None:
                try:
                    sink.close()
                except Exception:  # a closed or broken writer: nothing left to save
                    pass


class ForwardHooks:
    """One forward pre-hook (given the keyword arguments too) and one always-called forward hook
    on many modules, under one key; :meth:`remove` is safe twice.

    This is what ``register_forward_pre_hook`` and ``register_forward_hook(always_call=True)``
    do, without their ``RemovableHandle`` objects: nine objects per module, which the garbage
    collector walks on each of its collections while the hooks are in place. The key is taken
    from torch's own handle counter, so no handle anywhere shares it. Only the modules' hook
    dicts are held (they hold the hooks, which must not hold a module).
    """

    def __init__(self, modules: list[nn.Module], pre_hook: Callable[..., Any], post_hook: Callable[..., Any]) -> None:
        self._key = RemovableHandle.next_id
        RemovableHandle.next_id += 1
        self._dicts: list[dict] = []
        for module in modules:
            module._forward_pre_hooks[self._key] = pre_hook
            module._forward_pre_hooks_with_kwargs[self._key] = True
            module._forward_hooks[self._key] = post_hook
            module._forward_hooks_always_called[self._key] = True
            self._dicts += (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs, module._forward_hooks,
                            module._forward_hooks_always_called)

    def remove(self) -> None:
        dicts, self._dicts = self._dicts, []
        for hooks in dicts:
            hooks.pop(self._key, None)


class InertHooks:
    """The module hooks of a probe of one sampled step (its handles, :attr:`_handles`): removed
    by :meth:`remove`, safe twice, or left on the model inert (``keep_module_hooks``: a model
    found running inside compiled code, which was compiled with them). A hook does nothing once
    :attr:`inert` is set."""

    def __init__(self) -> None:
        self.inert = False
        self._handles: list[Any] = []

    def remove(self, keep_module_hooks: bool = False) -> None:
        """Take the hooks off (``keep_module_hooks``: leave them on, inert)."""
        self.inert = True
        if not keep_module_hooks:
            for handle in self._handles:
                handle.remove()
            self._handles = []


class CollectorClock:
    """The seconds the garbage collector runs while it is attached (a ``gc.callbacks`` entry,
    there only during a sampled step: off-steps pay nothing). It holds no engine."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def attach(self) -> None:
        self.seconds = 0.0
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


_owners: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def claim(model: nn.Module, engine: Any, failures: Any) -> None:
    """Make ``engine`` the model's engine. One that still watches it, never finished (a cell
    run again?), is finished first, and ``failures`` warns of it: its hooks do not stay."""
    previous = _owners.get(model)
    _owners[model] = weakref.ref(engine)
    previous_engine = None if previous is None else previous()
    if previous_engine is not None and previous_engine is not engine and previous_engine.state == "running":
        failures.warn(
            f"layerwatch: this {type(model).__name__} was still watched by an earlier {previous_engine.owner} that "
            "was not finished (a cell run again?); that one is finished now, so its hooks do not stay on the model"
        )
        previous_engine.finish()


class FailedForwardGuard:
    """``model.forward`` wrapped, as an instance attribute, while the guard is on: when the
    model's forward raises, ``on_failure`` runs before torch runs the model's always-call
    forward hooks, so it can remove every hook of ours, the model's own included (from
    inside those hooks it could not: torch is iterating them). ``remove()`` puts ``forward``
    back as it was, and is safe twice; guards may be stacked (a sampled step's over a run's)
    and removed in any order. Traced by Dynamo, the wrapper only calls through."""

    _MISSING = object()

    def __init__(self, model: nn.Module, on_failure: Callable[[], None]) -> None:
        # Neither the guard nor the wrapper holds the model: a model dropped mid-run is freed.
        model_ref = weakref.ref(model)
        below = [model.__dict__.get("forward", self._MISSING)]  # what this wrapper calls: a list, to unlink it

        @functools.wraps(model.forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                if below[0] is not FailedForwardGuard._MISSING:
                    return below[0](*args, **kwargs)
                owner = model_ref()  # the class's forward called with it: Dynamo 2.11 cannot trace function.__get__
                return type(owner).forward(owner, *args, **kwargs)
            except BaseException:
                if not is_compiling():
                    on_failure()
                raise

        del forward.__wrapped__  # functools.wraps' link to the bound method would hold the model
        try:
            forward.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]  # for who inspects it
        except (TypeError, ValueError):
            pass
        forward.layerwatch_below = below  # type: ignore[attr-defined]
        self._model = model_ref
        self._wrapper = weakref.ref(forward)
        model.forward = forward

    def remove(self) -> None:
        model, wrapper = self._model(), self._wrapper()
        if model is None or wrapper is None:
            return
        below = wrapper.layerwatch_below[0]
        above = model.__dict__.get("forward", self._MISSING)
        if above is wrapper:
            if below is self._MISSING:
                del model.forward
            else:
                model.forward = below
            return
        while getattr(above, "layerwatch_below", None) is not None:  # a guard put on since: unlinked from under it
            if above.layerwatch_below[0] is wrapper:
                above.layerwatch_below[0] = below
                return
            above = above.layerwatch_below[0]
        # replaced since by someone else's forward: theirs stays


class GradNormTaken:
    """The global gradient norm a training loop computes anyway (to clip it), handed to the
    engine's spike check (:meth:`Engine.observe`) each time it is: ``owner.name``, the
    method that computes it, is wrapped on the instance for the run's life. ``compute``
    (optional): what the wrapper calls instead of the method, returning the norm, for a method
    that computes it and keeps it (the wrapper then returns what the method would: None).
    ``remove()`` puts back what was there (safe twice; a wrapper put on after this one stays,
    and this one then only passes the call on). It holds the engine weakly."""

    _NONE = object()

    def __init__(self, engine: Any, owner: Any, name: str, compute: Optional[Callable[..., Any]] = None) -> None:
        engine_ref, method = weakref.ref(engine), getattr(owner, name)
        self._owner, self._name, self._before = owner, name, vars(owner).get(name, self._NONE)

        def taken(*args: Any, **kwargs: Any) -> Any:
            norm = (compute or method)(*args, **kwargs)
            engine = engine_ref()
            if norm is not None and engine is not None and engine.state == "running":
                engine.observe(norm, "grad_norm")
            return norm if compute is None else None

        self._wrapper = taken
        setattr(owner, name, taken)

    def remove(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None and vars(owner).get(self._name) is self._wrapper:
            if self._before is self._NONE:
                delattr(owner, self._name)
            else:
                setattr(owner, self._name, self._before)


def detached(error: Exception) -> Exception:
    """``error``, kept by a probe to report later, without its traceback or the exception it
    was raised during: those hold the training loop's frames (the trainer, the batch), which
    the probe's hooks on the model would keep alive."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


def entered_by_its_own_hook(stack_top: Any, this: Any) -> bool:
    """Whether a module whose forward hook runs now was entered by our pre-hook: not when an
    earlier pre-hook of the user's raised before ours ran (torch still runs always-call
    forward hooks then)."""
    return stack_top is this or sys.exc_info()[1] is None


def optimizer_hooks(optimizer: torch.optim.Optimizer, before: Callable[[Any], None], after: Callable[[Any], None]) -> list[Any]:
    """A step pre-hook calling ``before(optimizer)`` and a post-hook calling ``after(optimizer)``,
    both skipped inside compiled code. Registered once for a run: a hook added or removed
    between steps would change what a compiled ``optimizer.step`` is guarded on. Run eagerly
    around a compiled ``optimizer.step`` (as Python 3.13's Dynamo runs them), they and all they
    call are never compiled as frames of their own (:func:`inlined_only`)."""

    @inlined_only
    def pre_hook(opt: Any, args: Any, kwargs: Any) -> None:
        if not is_compiling():
            before(opt)

    @inlined_only
    def post_hook(opt: Any, args: Any, kwargs: Any) -> None:
        if not is_compiling():
            after(opt)

    return [optimizer.register_step_pre_hook(pre_hook), optimizer.register_step_post_hook(post_hook)]


def engine_step_hooks(engine: Any, optimizer: torch.optim.Optimizer, noted: Optional[Callable[[], None]] = None) -> list[Any]:
    """:func:`optimizer_hooks` that call ``engine.before_optimizer_step`` and
    ``engine.after_optimizer_step``, holding the engine weakly (the optimizer must not keep it
    alive); ``noted()``, when given, first in the pre-hook."""
    engine_ref = weakref.ref(engine)

    def before(opt: Any) -> None:
        if noted is not None:
            noted()
        if engine_ref() is not None:
            engine_ref().before_optimizer_step(opt)

    def after(opt: Any) -> None:
        if engine_ref() is not None:
            engine_ref().after_optimizer_step(opt)

    return optimizer_hooks(optimizer, before, after)


def tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``, walking tuples, lists, dicts and dataclasses; the rest skipped."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 8 or obj is None or isinstance(obj, (bool, int, float, str)):
        return  # (Dynamo 2.11 breaks the graph at is_dataclass(None): an attention's weights)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name, None), depth + 1)
