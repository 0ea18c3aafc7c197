"""A compiled model's sampled step, measured on an eager re-run of one of its micro-batches.

Nothing of layerwatch runs inside the user's compiled code. Any reader of a value inside a
compiled graph that the graph did not have (a hook's operator, a reduction) makes Inductor store
that value in its own dtype where the graph would have kept it in float32 inside a fused kernel,
so every later reader rounds differently (bfloat16 and float16 on any device; float32 too on a
GPU, where a kernel split in two contracts its multiply-adds otherwise); and a graph with such
readers is one more graph to compile. So a compiled step runs exactly the graphs it would run
without layerwatch: the same count, the same bits.

What a compiled model's sampled step gets of the per-module families comes from a second run of
one micro-batch of the step, with the step's weights, before the step's own forward (for a
model first found running inside compiled code at a sample, that sample's comes after it, before
the optimizer step: :meth:`Rerun.before_optimizer_step`) (:func:`run_forward_again`):

- **eager**: compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``, torch 2.6
  and later), so the probes' hooks see every module, and no graph is made or thrown away;
- **forward only**, with autograd off, in the model's training mode (dropout draws eager's
  masks, from the step's RNG state): nothing of the forward is kept but one module's outputs
  at a time and the probes' rows;
- **leaving no trace**: the RNG states, buffers, module attributes and modes are saved before it
  and put back after (:class:`~layerwatch.faults.replay.SavedState`), and DDP's flags: the step's own
  forward then draws and computes what it would have without it.

Its time counts as the sample's, in the overhead budget's measure. A re-run that fails (out of
memory, say) is said once and skipped: the step goes on as it would have.

Where the micro-batch comes from: the front door's closure (:meth:`Engine.replay_with
<layerwatch.engine.engine.Engine.replay_with>`; Lightning's callback runs ``training_step`` again, the
Hugging Face callback the model on its kept inputs), or, where the model's own call runs eagerly
around its compiled code (``torch.compile(model)``'s wrapper, a model whose blocks are compiled),
a forward pre-hook on it that keeps the call's arguments, by reference (:class:`Inputs`); for
``model.compile()``, its compiled call wrapped for the step. The step's first training forward
is the one run again (with gradient accumulation: its first micro-batch, said once).
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from layerwatch.distributed.sharding import innermost, is_writer_rank, world_size
from layerwatch.guards.failures import FailurePolicy
from layerwatch.guards.hooks import is_compiling
from layerwatch.probes import StepProbes
from layerwatch.probes.flex_attention import DenseTooLarge
from layerwatch.probes.selection import is_compiled
from layerwatch.faults.replay import SavedState, gradient_sync_off, replaying, run_eagerly

Rows = Callable[[int], Callable[[], Any]]  # the closure of a micro-batch's first n rows

# The most score bytes one FlexAttention call may build at once in a re-run (the operator run
# eagerly computes every score of the call at once).
DENSE_LIMIT = 1 << 30


def run_forward_again(model: nn.Module, closure: Callable[[], Any], probes: StepProbes, step: int, *,
                      writer: bool, params: Sequence[nn.Parameter], within: Optional[nn.Module],
                      dense_limit: Optional[int]) -> None:
    """``closure()`` (a forward of the step's micro-batch) with ``probes`` armed for one forward,
    compiled code eager, autograd off, DDP's sync off; the state put back after, whatever
    happened. The probes keep what they measured for :meth:`StepProbes.take`; a FlexAttention
    call that would build more than ``dense_limit`` bytes of scores stops it (:class:`DenseTooLarge`).

    Raises:
        Exception: what the forward raised (the probes are disarmed then).
    """
    saved = SavedState(model, copy_gradients=False)
    try:
        with gradient_sync_off(model, within, buffers=True), run_eagerly(), torch.no_grad(), _eager_flex_unsaid():
            probes.arm(model, params, step, writer=writer, eager=True, forward_only=True, dense_limit=dense_limit)
            try:
                closure()
            except BaseException:
                probes.disarm()  # nothing of a forward that failed is measured
                raise
            probes.unhook()
    finally:
        saved.restore()
        torch.clear_autocast_cache()  # weights it cast without autograd serve no later forward


@contextlib.contextmanager
def _eager_flex_unsaid() -> Iterator[None]:
    """Inside: torch's warning that FlexAttention runs unfused without torch.compile is not said
    (the re-run runs it so on purpose; the user's compiled call is fused)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def first_rows(obj: Any, rows: int, batch: Optional[int] = None) -> Any:
    """``obj`` with every tensor whose first dimension is the batch's (the first tensor's) cut to
    its first ``rows``, in tuples, lists and dicts (a mapping type kept); the rest as it is."""
    if batch is None:
        first = next(_tensors(obj), None)
        if first is None or first.dim() == 0:
            return obj
        batch = first.shape[0]
    if isinstance(obj, torch.Tensor):
        return obj[:rows] if obj.dim() > 0 and obj.shape[0] == batch else obj
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(first_rows(item, rows, batch) for item in obj)
    if isinstance(obj, dict):
        try:
            return type(obj)({key: first_rows(value, rows, batch) for key, value in obj.items()})
        except TypeError:  # a mapping type that is not built from a dict
            return {key: first_rows(value, rows, batch) for key, value in obj.items()}
    return obj


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class Inputs:
    """The model's training forwards while attached: each hands ``offer`` a closure that calls
    the model again with the same arguments (by reference, nothing copied), and one that calls
    it on their first rows. ``model``'s own call must run eagerly around its compiled code: a
    forward pre-hook on it; for ``model.compile()`` (whose call, hooks included, is compiled),
    its compiled call wrapped, as an instance attribute. Forwards with autograd off or in eval
    mode (evaluation), inside backward (a recompute) or traced are passed over. ``remove()`` is
    safe twice; it holds the model and ``offer`` weakly."""

    def __init__(self, model: nn.Module, offer: Callable[[Callable[[], Any], Rows], None]) -> None:
        self._model = weakref.ref(model)
        self._offer = weakref.WeakMethod(offer) if hasattr(offer, "__self__") else (lambda: offer)
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
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        model, wrapper = self._model(), self._wrapper() if self._wrapper is not None else None
        self._wrapper = None
        if model is not None and wrapper is not None and model.__dict__.get("_compiled_call_impl") is wrapper:
            model._compiled_call_impl = wrapper.layerwatch_previous  # unless compiled again since: theirs stays

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self._note(args, kwargs)

    def _note(self, args: tuple, kwargs: dict[str, Any]) -> None:
        model, offer = self._model(), self._offer()
        if (model is None or offer is None or is_compiling() or not torch.is_grad_enabled() or not model.training
                or torch._C._current_graph_task_id() != -1 or replaying()):
            return
        target = innermost(model)
        offer(lambda: target(*args, **kwargs), lambda n: lambda: target(*first_rows(args, n), **first_rows(kwargs, n)),
              kept=True)


class Rerun:
    """The engine's part for a model that runs compiled (:attr:`StepProbes.compiled`): on a sampled
    step, the first micro-batch offered (:meth:`offer`) is run again eagerly, forward only, with
    the probes armed (:func:`run_forward_again`); what is not measured so is said once.

    Args:
        probes: The engine's probes (which know whether the model runs compiled).
        failures: Where a failure is warned about.
    """

    def __init__(self, probes: StepProbes, failures: FailurePolicy) -> None:
        self._probes, self.failures = probes, failures
        self._keeps_inputs = False  # the model's own call runs eagerly around its compiled code (Inputs)
        self._inputs: Optional[Inputs] = None
        self._model: Callable[[], Optional[nn.Module]] = lambda: None
        self._within: Callable[[], Optional[nn.Module]] = lambda: None
        self._step: Optional[int] = None  # the sampled step whose micro-batch is awaited, while armed
        self._params: Sequence[nn.Parameter] = ()
        self._writer = False
        self._together = self._collective = False
        self._ran = False  # this step's micro-batch was run again
        self._first: Optional[tuple[Callable[[], Any], Optional[Rows]]] = None  # see found_compiled
        self._offered = [0, 0]  # micro-batches offered this step, by the door and kept (Inputs)
        self._fits: Optional[int] = None  # the rows of a micro-batch that fit in a re-run, once one did not
        self.seconds = 0.0  # this step's re-run, which counts as the sample's cost

    def start(self, model: nn.Module, within: Optional[nn.Module], together: bool, collective: bool = False) -> None:
        """The run's model (held weakly), the module it is wrapped in (DDP's flags), whether
        the ranks measure together (sharded, or routers counted over the ranks: every rank
        re-runs) or rank 0 alone (DDP), and whether their forward is ``collective`` (sharded)."""
        self._model = weakref.ref(model)
        self._within = (lambda: None) if within is None else weakref.ref(within)
        self._keeps_inputs = is_compiled(model)
        self._together, self._collective = together, collective
        # rank 0 alone re-runs under DDP: a forward that is collective (SyncBatchNorm) would wait for the others
        self._alone_and_collective = (world_size() > 1 and not together
                                      and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()))

    def arm(self, step: int, params: Sequence[nn.Parameter], writer: bool) -> None:
        """Sampled ``step`` opens: await its first micro-batch (on a model not known yet to run
        compiled, kept for :meth:`found_compiled`)."""
        self.disarm()
        self.seconds, self._ran, self._offered, self._first = 0.0, False, [0, 0], None
        if not self._probes.runtime_on:
            if not (self._probes.structure_pending and writer):
                return
            if self._together:  # every rank re-runs a sharded (collective) forward, or none: not for rank 0's table
                if self._probes.compiled:
                    self.failures.say_once("rerun-table-together", (
                        "layerwatch: the compiled model's ranks measure together, and with no per-module family on "
                        "they do not run a micro-batch again, so its layer table is not recorded"))
                return
        why = ("this torch (before 2.6) cannot run compiled code eagerly" if not hasattr(torch.compiler, "set_stance")
               else "the model's SyncBatchNorm is collective, and rank 0 alone would run it again (data parallel ranks "
               "are measured on rank 0)" if self._alone_and_collective else None)
        if why is not None:
            if self._probes.compiled:
                self.failures.say_once("compiled-not-rerun", f"layerwatch: {why}, so a compiled model's per-module "
                                       "families are not measured (the parameter families are)")
            return
        self._step, self._params, self._writer = step, params, writer
        model = self._model()
        if self._probes.compiled and self._keeps_inputs and model is not None:
            self.failures.run("keep the sampled step's inputs", lambda: self._keep(model), step)

    def _keep(self, model: nn.Module) -> None:
        self._inputs = Inputs(model, self.offer)

    def offer(self, closure: Callable[[], Any], rows: Optional[Rows] = None, kept: bool = False) -> None:
        """A micro-batch of the open step, as a closure that runs its forward again (its result
        is not used); ``rows(n)``: the same on its first ``n`` rows, where it can be cut; ``kept``:
        from :class:`Inputs` (a door may offer the same micro-batch too). The first of a sampled
        step is run again now, before its own forward."""
        step = self._step
        if step is None:
            return
        self._offered[kept] += 1
        if self._ran:
            return
        if not self._probes.compiled:  # unless its first sample shows that it runs compiled after all
            self._first = self._first or (closure, rows)
            return
        self._ran = True
        model = self._model()
        if model is None:
            return
        started = time.perf_counter()
        try:
            self._run(model, step, closure, rows)
        finally:
            self.seconds += time.perf_counter() - started

    def before_optimizer_step(self, step: int, trained: Callable[[], bool]) -> None:
        """Before the sampled step's optimizer step: where its forward (and the backward that
        ``trained()`` says ran) went by its hooks unseen, the model runs inside compiled code
        (:meth:`StepProbes.found_compiled`), and its first micro-batch, if one was offered, is run
        again now, its weights still the step's. Its time is the caller's to count (the engine's
        optimizer-step point), not :attr:`seconds`."""
        if self._probes.compiled or not self._probes.found_compiled(step, trained()):
            return
        first, self._first = self._first, None
        if first is not None:
            seconds = self.seconds
            self._offered[False] -= 1  # offered again, now that it counts
            self.offer(*first)
            self.seconds = seconds

    def _run(self, model: nn.Module, step: int, closure: Callable[[], Any], rows: Optional[Rows]) -> None:
        """``closure()`` run again; where it is too large to run eagerly, the first rows that fit, from
        then on (where ``rows`` can cut it), said once."""
        fits = self._fits if rows is not None else None
        for attempt in range(2):
            error = self._again(model, step, closure if fits is None else self._cut(rows, fits))
            if error is None:
                return
            if rows is None or error.rows < 1 or (fits is not None and error.rows >= fits) or attempt == 1:
                why = ("it came as a closure" if rows is None else "not one fits" if error.rows < 1
                       else f"its first {fits} rows did not fit either")
                self.failures.say_once("rerun-too-large", (
                    f"layerwatch: {error}: the compiled model's re-run cannot cut this micro-batch to fewer rows "
                    f"({why}), so its sampled steps' per-module families are not measured"))
                return
            fits = self._fits = error.rows
            self.failures.say_once("rerun-rows", (
                f"layerwatch: {error}; the compiled model's sampled steps run the first {fits} rows of their "
                "micro-batch again instead, and their per-module families are of those rows"))

    @staticmethod
    def _cut(rows: Rows, fits: int) -> Callable[[], Any]:
        """The closure of the first ``fits`` rows, cut when it runs (where a failure is caught)."""
        return lambda: rows(fits)()

    def _again(self, model: nn.Module, step: int, closure: Callable[[], Any]) -> Optional[DenseTooLarge]:
        """:func:`run_forward_again` of ``closure``; the call too large to run eagerly that stopped it,
        or None (a failure of another kind is warned once)."""
        too_large: list[DenseTooLarge] = []

        def again() -> None:
            try:
                # no rank may stop a collective forward alone: no bound on FlexAttention's scores there
                run_forward_again(model, closure, self._probes, step, writer=self._writer, params=self._params,
                                  within=self._within(), dense_limit=None if self._collective else DENSE_LIMIT)
            except DenseTooLarge as e:
                too_large.append(e)

        self.failures.run("run a micro-batch of the sampled step again, eagerly", again, step)
        return too_large[0] if too_large else None

    def disarm(self) -> None:
        """The step is over (or dropped): its inputs are no longer kept."""
        if self._inputs is not None:
            self._inputs.remove()
            self._inputs = None
        self._step = None

    remove = disarm  # what the engine's attachments call when it is finished or collected

    def close(self, step: int) -> float:
        """Sampled ``step`` ends: what was not run again is said once. Returns the re-run's seconds."""
        awaited = self._step is not None and self._probes.compiled
        self.disarm()
        self._first = None
        if awaited and not self._ran and is_writer_rank():
            self.failures.warn_once("rerun-no-batch", (
                f"layerwatch: the model runs compiled, and no micro-batch of sampled step {step} reached layerwatch to "
                "run again eagerly: its per-module families (activations, attention, NaN/Inf flags, fwd_ms, the layer "
                "table) are not measured. Give the Inspector the module you call (torch.compile(model), or a model "
                "whose blocks are compiled), or the batch: Inspector.replay_with(closure) before each step's forward "
                "(a model called from a compiled function, a compiled training step)"))
        if max(self._offered) > 1 and self._ran and is_writer_rank():
            self.failures.say_once("rerun-first", (
                f"layerwatch: sampled step {step} ran {max(self._offered)} training forwards (the micro-batches of "
                "gradient accumulation, or several calls of the model): the compiled model's per-module families are "
                "of the first, run again eagerly"))
        if self._ran and is_writer_rank():
            self.failures.say_once("rerun-backward", (
                "layerwatch: the model runs compiled: its sampled steps' per-module families come from an eager, "
                "forward-only re-run of one micro-batch (nothing of layerwatch runs inside compiled code), so fwd_ms is "
                "eager time, and bwd_ms, saved_bytes, cuda_alloc_bytes and the backward's NaN/Inf flags are not measured "
                "(a NaN's replay measures them)"))
        return self.seconds
