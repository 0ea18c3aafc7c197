"""The runtime probe: the hooks of one sampled step on the selected modules, and what they
measured (:class:`ProbeResult`)."""

from __future__ import annotations

import functools
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Collection, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.distributed.sharding import is_dtensor, local_tensors, spread, walk
from layerwatch.guards.hooks import ForwardHooks, detached, entered_by_its_own_hook, inlined_only, is_compiling, tensors_in
from layerwatch.probes.result import ModuleTrace, Offender, ProbeResult
from layerwatch.probes.clocks import CudaClock, HostClock
from layerwatch.probes.evidence import Evidence
from layerwatch.probes.outputs import floats
from layerwatch.probes.saved import SavedBytes
from layerwatch.probes.shards import LocalShards
from layerwatch.probes.selection import probe_names
from layerwatch.probes.weights import NonfiniteWeights, WeightCheck
from layerwatch.measure.zero import is_zero3_param
from layerwatch.distributed.stages import in_shape_inference


class RuntimeProbe:
    """Hooks on the selected modules for one sampled step; ``remove()`` is safe twice.

    A hook that fails records the error and the probe goes quiet; it never raises into
    the training step. Forwards with autograd off (validation, unless ``forward_only``: a
    compiled model's eager re-run), recomputes inside backward (activation checkpointing) and
    a pipeline stage's shape inference are not recorded. Traced by Dynamo (a model called
    from compiled code), every hook returns before anything.

    A hook reads local data only, never an op on a DTensor (which may hide a collective):
    a DTensor's local tensor. A tensor spread over ranks (a ``Shard`` or ``Partial`` DTensor,
    or the local shard a tensor-parallel module hands on) has its flag and its output row
    combined with the other ranks' after the step (:meth:`result`, ``together``); every rank
    runs these hooks then, and :meth:`spread_work` is what they first agree on.

    What a hook keeps is mostly ints in flat lists: a call is a number, its fields are
    entries of per-call lists, and the spans, events and flags are runs of ints. A tuple,
    list or closure per module call would stay alive to the end of the step, and the
    garbage collector walks every such object on each of its collections (on a model of
    600 modules, that cost more than the hooks themselves).
    """

    def __init__(
        self,
        modules: Sequence[tuple[str, nn.Module]],
        *,
        families: Sequence[str],
        bins: int,
        zeros: bool,
        centered: bool,
        parameters: Sequence[nn.Parameter],
        workspace: Optional[S.Workspace] = None,
        cuda_events: Optional[list[Any]] = None,
        forward_only: bool = False,
    ) -> None:
        self.error: Optional[BaseException] = None
        # A compiled model's eager re-run (rerun.py): one forward with autograd off, recorded;
        # nothing of a backward, of the bytes saved for it or of the allocator's growth (a forward
        # without autograd frees what a training forward keeps): those stay None, never 0.
        self.forward_only = forward_only
        self.inert = False  # hooks kept on a model found running inside compiled code (StepProbes)
        self._host_ns = 0
        self._latency = "latency" in families
        self._memory = "memory" in families
        self._activations = "activations" in families
        self._nonfinite = "nonfinite" in families
        self._backward = (self._latency or self._nonfinite) and not forward_only
        self._bins, self._zeros, self._centered = bins, zeros, centered
        device = next((p.device for p in parameters), torch.device("cpu"))
        self._cuda = device.type == "cuda"
        self._clock: Any = CudaClock([] if cuda_events is None else cuda_events) if self._cuda else HostClock()
        self._names = probe_names(modules)
        self._index = {id(module): index for index, (_, module) in enumerate(modules)}
        count = len(modules)
        self._calls = [0] * count  # per module
        self._activation_bytes = [0] * count
        self._cuda_alloc_bytes = [0] * count
        self._saved = SavedBytes(parameters if self._memory and not forward_only else (), count, self._running_modules)
        # Per forward call (a call is its position in these lists): its module, the hook
        # interval after which it starts, its input flags (a run of ``_runs``), the memory
        # allocated before it, the interval its backward starts at (-1: not yet) and the
        # flag of the gradient of its outputs (a run of ``_runs``).
        self._call_module: list[int] = []
        self._call_start: list[int] = []
        self._call_inputs: list[int] = []
        self._call_alloc: list[int] = []
        self._call_bwd_start: list[int] = []
        self._call_grad_outputs: list[int] = []
        self._call_in_group: list[Any] = []  # the group its inputs are plain shards over, or None
        self._call_group: list[Any] = []  # idem, its outputs
        self._stack: list[int] = []  # the calls whose forward is running
        # Outermost calls whose inputs need no gradient: the module, whose parameters' gradients
        # are read when the pass ends (then, not at its forward: FSDP swaps its parameters)
        self._ends_with_pass: dict[int, Any] = {}
        self._shards = LocalShards()  # tensor parallel: the plain tensors that are one rank's shard
        self._ignored_depth = 0
        # Hook intervals: marks at entry and exit of every hook, in firing order.
        self._entered: list[Any] = []
        self._left: list[Any] = []
        self._fwd_spans: list[int] = []  # (module, start interval, end interval) after each other
        self._bwd_spans: list[int] = []
        workspace = workspace if workspace is not None else S.Workspace()
        self._evidence = Evidence(bins, zeros, centered, workspace)  # NaN/Inf flags and stats rows
        self._fwd_events: list[int] = []  # (module, inputs run, outputs run) after each other
        self._bwd_events: list[int] = []
        self._row_of: dict[int, int] = {}  # module -> row
        self._grad_handles: list[Any] = []
        self._handles: list[Any] = [ForwardHooks([module for _, module in modules], self._pre_hook, self._post_hook)]
        if any(map(is_dtensor, parameters)):  # the modules a parallel style may have made local
            parallel = [module for _, module in modules if any(map(is_dtensor, module.parameters(recurse=False)))]
            self._handles += [module.register_forward_hook(self._raw_output_hook, prepend=True) for module in parallel]

    # ------------------------------------------------------------------ lifecycle

    def remove(self, keep_module_hooks: bool = False) -> None:
        """Remove the hooks, but the module hooks with ``keep_module_hooks`` (compiled code runs them)."""
        handles = self._grad_handles if keep_module_hooks else self._handles + self._grad_handles
        for handle in handles:
            handle.remove()
        self._grad_handles = []
        if not keep_module_hooks:
            self._handles = []
        self._saved.exit()
        self._stack = []
        self._evidence.forget()
        self._ends_with_pass = {}
        self._shards.forget()

    def spread_work(self) -> list[int]:
        """What :meth:`result` ``together`` does with the other ranks: how many flags and rows
        of spread tensors, per group and in order. Every rank must hold the same, or none may
        do it."""
        return self._evidence.spread_work()

    def result(self, together: bool = False, keep_module_hooks: bool = False,
               weights: Optional[WeightCheck] = None) -> ProbeResult:
        """The step's measurements: one host transfer for every flag and stats row (and the
        ``weights`` check's norms: a module computing with a non-finite weight is no offender).
        With ``together`` (every rank calls it, once they agreed on :meth:`spread_work`) the
        flags and rows of spread tensors are combined with the other ranks', first: every
        collective is issued before anything of this rank's alone can fail."""
        self.remove(keep_module_hooks)
        error = None
        combines = ([self._evidence.combine] + ([weights.combine] if weights is not None else [])) if together else []
        for combine in combines:
            try:
                combine()
            except Exception as e:
                error = error or e
        spread_rows = self._evidence.spread_rows(together)
        if error is not None:
            raise error
        weight_pieces = [] if weights is None else weights.pieces()
        nonfinite, rows_host, weight_host = self._evidence.read(weight_pieces, spread_rows)
        used = NonfiniteWeights() if weights is None else weights.seen(weight_host)
        marks = self._clock.resolve([m for pair in zip(self._entered, self._left) for m in pair])
        entered, left = marks[0::2], marks[1::2]
        # nested[k]: time spent in hooks 0..k-1; a span subtracts the hooks inside it.
        nested = np.concatenate([[0.0], np.cumsum(left - entered)])
        traces = [ModuleTrace(name) for name in self._names]
        for index, trace in enumerate(traces):
            trace.calls = self._calls[index]
            if self._memory:
                trace.activation_bytes = self._activation_bytes[index]
                if not self.forward_only:
                    trace.saved_bytes = self._saved.bytes[index]
                    trace.cuda_alloc_bytes = self._cuda_alloc_bytes[index] if self._cuda else None
            if self._nonfinite:
                trace.nonfinite = False
        for spans, attribute in ((self._fwd_spans, "fwd_ms"), (self._bwd_spans, "bwd_ms")) if self._latency else ():
            for index, start, end in zip(spans[0::3], spans[1::3], spans[2::3]):
                trace = traces[index]
                ms = max(entered[end] - left[start] - (nested[end] - nested[start + 1]), 0.0)
                setattr(trace, attribute, (getattr(trace, attribute) or 0.0) + ms)
        failed = S.Rows(rows_host).failed
        for index, row in self._row_of.items():
            if not failed[row]:
                traces[index].activation_row = rows_host[row]
        offender = user = None
        if self._nonfinite:
            for events, phase in ((self._fwd_events, "forward"), (self._bwd_events, "backward")):
                for index, inputs, outputs in zip(events[0::3], events[1::3], events[2::3]):
                    bad_out = any([nonfinite[f] for f in self._evidence.run(outputs)])
                    trace = traces[index]
                    trace.nonfinite = trace.nonfinite or bad_out
                    if offender is None and bad_out and not any([nonfinite[f] for f in self._evidence.run(inputs)]):
                        if trace.name not in used.modules:
                            offender = Offender(trace.name, phase)
                        elif user is None:
                            user = Offender(trace.name, phase)
        return ProbeResult([t for t in traces if t.calls], offender, user, used.names, rerun=self.forward_only)

    # ------------------------------------------------------------------ hooks
    # Hooks hold the probe (names and indices), never a module or the inspector.

    # A module this probe does not know (a deep copy of a probed one, made mid-step, carries
    # its hooks) is passed over.

    @inlined_only
    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if is_compiling() or self.inert:  # traced by Dynamo: nothing, not even a store
            return
        index = self._index.get(id(module))
        if index is not None and self.error is None:
            self._guarded(self._enter, index, args, module)

    @inlined_only
    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if is_compiling() or self.inert:
            return
        index = self._index.get(id(module))
        if index is None:
            return
        if self._ignored_depth:
            self._ignored_depth -= 1
        elif self.error is None:
            self._guarded(self._leave, index, output)
        if not self._stack:
            self._saved.exit()

    def _raw_output_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Runs before the module's other output hooks (a tensor-parallel style's, which may
        make a spread DTensor local): how its output is spread."""
        if is_compiling() or self.inert or not is_dtensor(output):
            return
        index = self._index.get(id(module))
        if index is not None:
            self._shards.raw[index] = (spread(output), output._local_tensor.shape)

    def __deepcopy__(self, memo: dict) -> "RuntimeProbe":
        return self  # a module copied mid-step keeps calling this probe, which passes it over

    def _guarded(self, action: Callable[..., None], *args: Any) -> None:
        entered = perf_counter_ns()
        device_mark = self._clock.mark() if self._cuda else None
        try:
            action(*args)
        except Exception as e:  # a probe must never break the training step
            self.error = detached(e)
            self._stack = []
            self._saved.exit()
        self._entered.append(entered if device_mark is None else device_mark)
        self._left.append(perf_counter_ns() if device_mark is None else self._clock.mark())
        if device_mark is not None:
            self._host_ns += perf_counter_ns() - entered
        else:
            self._host_ns += self._left[-1] - entered

    @property
    def ran(self) -> bool:
        """Whether a hook recorded a module call."""
        return bool(self._call_module)

    def aside(self, action: Callable[[], None]) -> None:
        """``action()`` timed as a hook's work: left out of every module's time (the re-run's
        transformer signals, measured as their calls end). It must not raise."""
        if self.error is None:
            self._guarded(action)

    @property
    def hook_seconds(self) -> float:
        """Host time spent in the hooks so far (the probes' own cost)."""
        return self._host_ns / 1e9

    def _running_modules(self) -> Collection[int]:
        """The modules whose forward is running (none once a hook failed)."""
        if self.error is not None:
            return ()
        return dict.fromkeys([self._call_module[call] for call in self._stack])

    def _enter(self, index: int, args: tuple, module: nn.Module) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute inside backward
        if self._ignored_depth or (not self._stack and ((not torch.is_grad_enabled() and not self.forward_only)
                                                        or in_shape_inference())):
            self._ignored_depth += 1
            return
        if not self._stack and self._memory and not self.forward_only:
            self._saved.enter()
        tensors = list(args) if len(args) == 1 and type(args[0]) is torch.Tensor else list(tensors_in(args))
        call = len(self._call_module)
        self._call_module.append(index)
        self._call_start.append(len(self._entered))
        self._call_inputs.append(self._evidence.add_run([self._evidence.flag(t) for t in floats(tensors)]) if self._nonfinite else -1)
        self._call_alloc.append(torch.cuda.memory_allocated() if self._memory and self._cuda else 0)
        self._call_bwd_start.append(-1)
        self._call_grad_outputs.append(-1)
        self._call_in_group.append(self._shards.group_of(tensors) if self._shards.of else None)
        self._call_group.append(None)
        if self._backward and torch.is_grad_enabled():
            watched = [t for t in tensors if t.requires_grad]
            if watched:
                self._grad_handles.append(on_gradients(watched, self, call, done=True))
            elif not self._stack:  # the model itself: its backward ends with the pass (a hook per parameter would not)
                self._ends_with_pass[call] = weakref.ref(module)
            else:  # a ZeRO-3 parameter is an empty placeholder here: no hook may be put on it
                watched = [p for p in module.parameters() if p.requires_grad and not is_zero3_param(p)]
                if watched:
                    self._grad_handles.append(on_gradients(watched, self, call, done=True))
        self._stack.append(call)

    def _leave(self, index: int, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        if not entered_by_its_own_hook(self._call_module[self._stack[-1]] if self._stack else None, index):
            return
        call = self._stack.pop()
        if self._call_module[call] != index:
            raise RuntimeError(f"module calls out of order: left {self._names[index]!r} while in "
                               f"{self._names[self._call_module[call]]!r}")
        first_call = self._calls[index] == 0
        self._calls[index] += 1
        self._fwd_spans += (index, self._call_start[call], len(self._entered))
        tensors = [output] if type(output) is torch.Tensor else list({id(t): t for t in tensors_in(output)}.values())
        if self._memory:  # this rank's bytes
            held = tensors if type(output) is torch.Tensor else local_tensors(tensors)
            self._activation_bytes[index] += sum([t.numel() * t.element_size() for t in held])
            if self._cuda:
                self._cuda_alloc_bytes[index] += torch.cuda.memory_allocated() - self._call_alloc[call]
        measured = floats(tensors)
        group = None
        if self._shards.raw or self._call_in_group[call] is not None:  # tensor parallel in sight
            group = self._call_group[call] = self._shards.output_group(index, self._call_in_group[call], measured)
        if self._activations and first_call and measured:
            row = self._evidence.row(measured, group)
            if row is not None:
                self._row_of[index] = row
        if self._nonfinite:
            self._fwd_events += (index, self._call_inputs[call], self._evidence.add_run([self._evidence.flag(t, group) for t in measured]))
        if self._backward:
            needing = [t for t in measured if t.requires_grad]
            if needing:
                self._grad_handles.append(on_gradients(needing, self, call, done=False))

    def _backward_starts(self, call: int, grad: torch.Tensor) -> None:
        if not is_compiling() and self.error is None and self._call_bwd_start[call] < 0:
            self._guarded(self._start_backward, call, grad)

    def _start_backward(self, call: int, grad: torch.Tensor) -> None:
        self._call_bwd_start[call] = len(self._entered)
        if self._nonfinite and grad is not None:
            self._call_grad_outputs[call] = self._evidence.add_run([self._evidence.flag(grad, self._call_group[call])])
        module = self._ends_with_pass.pop(call, None)
        if module is not None:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._pass_done, call, module))

    def _pass_done(self, call: int, module: Any) -> None:
        """The end of the backward pass of the model's own call: its gradients are those of
        its parameters as they are now (FSDP has put its sharded ones back, with their
        gradients), flagged together (one fused norm per device)."""
        if not is_compiling() and self.error is None and self._call_bwd_start[call] >= 0:
            model = module()
            grads = [] if model is None else gradients_of(model)
            self._guarded(self._finish_backward, call, grads, True)  # fused

    def _backward_done(self, call: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        if not is_compiling() and self.error is None and self._call_bwd_start[call] >= 0:
            self._guarded(self._finish_backward, call, grads)

    def _finish_backward(self, call: int, grads: Sequence[Optional[torch.Tensor]], fused: bool = False) -> None:
        index = self._call_module[call]
        self._bwd_spans += (index, self._call_bwd_start[call], len(self._entered))
        self._call_bwd_start[call] = -1
        if self._nonfinite:
            grads = floats([g for g in grads if g is not None])
            group = self._call_in_group[call]
            flags = self._evidence.flag_together(grads) if fused else [self._evidence.flag(g, group) for g in grads]
            self._bwd_events += (index, self._call_grad_outputs[call], self._evidence.add_run(flags))


class GradientHook:
    """A tensor hook for one call: its backward starts (``done`` False: called with the gradient
    of one of its outputs) or is done (called with the gradients of its inputs, or with one
    of them). One object holding the probe and the call's number: a ``functools.partial``
    of a bound method is three, for the garbage collector to walk."""

    __slots__ = ("probe", "call", "done")

    def __init__(self, probe: "RuntimeProbe", call: int, done: bool) -> None:
        self.probe, self.call, self.done = probe, call, done

    def __call__(self, grad: Any) -> None:
        if not self.done:
            self.probe._backward_starts(self.call, grad)
        else:
            self.probe._backward_done(self.call, (grad,) if grad is None or isinstance(grad, torch.Tensor) else grad)


def gradients_of(model: nn.Module) -> list[Optional[torch.Tensor]]:
    """The gradients of ``model``'s parameters that require one, read from each module's own
    (a parameter two modules hold comes twice: its NaN flag is the same): no generator resumed
    per parameter, as ``model.parameters()`` is."""
    return [p.grad for _, m in walk(model) for p in m._parameters.values() if p is not None and p.requires_grad]


def on_gradients(tensors: list[torch.Tensor], probe: "RuntimeProbe", call: int, done: bool) -> Any:
    """A :class:`GradientHook` on ``tensors``: a multi-grad hook (any of them for a start, all
    of them for a done); for one tensor (most modules) its plain tensor hook, which fires at
    the same moment and allocates a tenth of the objects."""
    hook = GradientHook(probe, call, done)
    if len(tensors) > 1:
        return torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="all" if done else "any")
    return tensors[0].register_hook(hook)
