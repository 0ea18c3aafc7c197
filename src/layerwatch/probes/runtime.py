"""The runtime probe: the hooks of one sampled step on the selected modules. What they
record is a :class:`~layerwatch.probes.calls.CallLog`; what they measured, a
:class:`~layerwatch.probes.result.ProbeResult` (:mod:`~layerwatch.probes.assembly`)."""

from __future__ import annotations

import functools
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Collection, Optional, Sequence

import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.distributed.sharding import is_dtensor, local_tensors, spread
from layerwatch.guards.hooks import ForwardHooks, detached, entered_by_its_own_hook, inlined_only, is_compiling, tensors_in
from layerwatch.probes.assembly import assemble
from layerwatch.probes.calls import CallLog, Measures
from layerwatch.probes.clocks import CudaClock, HostClock
from layerwatch.probes.evidence import Evidence, SpreadWork
from layerwatch.probes.gradients import gradients_of, on_gradients
from layerwatch.probes.outputs import floats
from layerwatch.probes.result import ProbeResult, Signals
from layerwatch.probes.saved import SavedBytes
from layerwatch.probes.shards import LocalShards
from layerwatch.probes.selection import probe_names
from layerwatch.probes.weights import NonfiniteWeights, WeightCheck
from layerwatch.distributed.sharding import is_zero3_param
from layerwatch.distributed.pipelining import in_shape_inference


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

    What a hook keeps is mostly ints in flat lists (:class:`~layerwatch.probes.calls.CallLog`).
    """

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], *, families: Sequence[str], bins: int, zeros: bool,
                 centered: bool, parameters: Sequence[nn.Parameter], workspace: Optional[S.Workspace] = None,
                 cuda_events: Optional[list[Any]] = None, forward_only: bool = False) -> None:
        self.error: Optional[BaseException] = None
        self.forward_only = forward_only  # a compiled model's eager re-run (see Measures)
        self.inert = False  # hooks kept on a model found running inside compiled code (StepProbes)
        self._host_ns = 0
        device = next((p.device for p in parameters), torch.device("cpu"))
        self._cuda = device.type == "cuda"
        self._measures = measures = Measures.of(families, forward_only, self._cuda)
        self._memory, self._nonfinite, self._backward = measures.memory, measures.nonfinite, measures.backward
        self._activations = measures.activations
        self._clock: Any = CudaClock([] if cuda_events is None else cuda_events) if self._cuda else HostClock()
        self._names = probe_names(modules)
        self._index = {id(module): index for index, (_, module) in enumerate(modules)}
        self._log = CallLog(len(modules))
        self._saved = SavedBytes(parameters if self._memory and not forward_only else (), len(modules),
                                 self._running_modules)
        self._stack: list[int] = []  # the calls whose forward is running
        # Outermost calls whose inputs need no gradient: the module, whose parameters' gradients
        # are read when the pass ends (then, not at its forward: FSDP swaps its parameters)
        self._ends_with_pass: dict[int, Any] = {}
        self._shards = LocalShards()  # tensor parallel: the plain tensors that are one rank's shard
        self._ignored_depth = 0
        # NaN/Inf flags and stats rows
        self._evidence = Evidence(bins, zeros, centered, workspace if workspace is not None else S.Workspace())
        self._grad_handles: list[Any] = []
        self._handles: list[Any] = [ForwardHooks([module for _, module in modules], self._pre_hook, self._post_hook)]
        if any(map(is_dtensor, parameters)):  # the modules a parallel style may have made local
            parallel = [module for _, module in modules if any(map(is_dtensor, module.parameters(recurse=False)))]
            self._handles += [module.register_forward_hook(self._raw_output_hook, prepend=True) for module in parallel]

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

    def spread_work(self) -> SpreadWork:
        """What :meth:`result` ``together`` does with the other ranks: how many flags and rows
        of spread tensors, per group and in order. Every rank must hold the same, or none may
        do it."""
        return self._evidence.spread_work()

    def fail(self, error: BaseException) -> None:
        """This probe failed (``error``; or another rank's did): its hooks go quiet, and its
        measurements are not taken."""
        self.error = error

    def keep_inert(self) -> None:
        """Leave the module hooks on the model, doing nothing, until :meth:`remove` (the model
        runs inside compiled code, which was compiled with them: see StepProbes); the gradient
        hooks go."""
        self.inert = True
        self.remove(keep_module_hooks=True)

    def result(self, together: bool = False, keep_module_hooks: bool = False,
               weights: Optional[WeightCheck] = None, transformer: Optional[Signals] = None) -> ProbeResult:
        """The step's measurements, with the ``transformer`` probes' signals: one host transfer
        for every flag and stats row (and the ``weights`` check's norms: a module computing
        with a non-finite weight is no offender). With ``together`` (every rank calls it, once
        they agreed on :meth:`spread_work`) the flags and rows of spread tensors are combined
        with the other ranks', first: every collective is issued before anything of this
        rank's alone can fail."""
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
        log = self._log
        marks = self._clock.resolve([m for pair in zip(log.entered, log.left) for m in pair])
        return assemble(log, self._names, self._measures, saved_bytes=self._saved.bytes, marks=marks,
                        rows_host=rows_host, nonfinite=nonfinite, run=self._evidence.run, used=used,
                        transformer=transformer)

    # The hooks hold the probe (names and indices), never a module or the inspector. A module
    # this probe does not know (a deep copy of a probed one, made mid-step, carries its hooks)
    # is passed over.

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
        self._log.entered.append(entered if device_mark is None else device_mark)
        self._log.left.append(perf_counter_ns() if device_mark is None else self._clock.mark())
        if device_mark is not None:
            self._host_ns += perf_counter_ns() - entered
        else:
            self._host_ns += self._log.left[-1] - entered

    @property
    def ran(self) -> bool:
        """Whether a hook recorded a module call."""
        return bool(self._log.module)

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
        return dict.fromkeys([self._log.module[call] for call in self._stack])

    def _enter(self, index: int, args: tuple, module: nn.Module) -> None:
        log = self._log
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute inside backward
        if self._ignored_depth or (not self._stack and ((not torch.is_grad_enabled() and not self.forward_only)
                                                        or in_shape_inference())):
            self._ignored_depth += 1
            return
        if not self._stack and self._memory and not self.forward_only:
            self._saved.enter()
        tensors = list(args) if len(args) == 1 and type(args[0]) is torch.Tensor else list(tensors_in(args))
        call = len(log.module)
        log.module.append(index)
        log.start.append(len(log.entered))
        log.inputs.append(self._evidence.add_run([self._evidence.flag(t) for t in floats(tensors)]) if self._nonfinite else -1)
        log.alloc.append(torch.cuda.memory_allocated() if self._memory and self._cuda else 0)
        log.bwd_start.append(-1)
        log.grad_outputs.append(-1)
        log.in_group.append(self._shards.group_of(tensors) if self._shards.of else None)
        log.group.append(None)
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
        log = self._log
        if torch._C._current_graph_task_id() != -1:
            return
        if not entered_by_its_own_hook(log.module[self._stack[-1]] if self._stack else None, index):
            return
        call = self._stack.pop()
        if log.module[call] != index:
            raise RuntimeError(f"module calls out of order: left {self._names[index]!r} while in "
                               f"{self._names[log.module[call]]!r}")
        first_call = log.calls[index] == 0
        log.calls[index] += 1
        log.fwd_spans += (index, log.start[call], len(log.entered))
        tensors = [output] if type(output) is torch.Tensor else list({id(t): t for t in tensors_in(output)}.values())
        if self._memory:  # this rank's bytes
            held = tensors if type(output) is torch.Tensor else local_tensors(tensors)
            log.activation_bytes[index] += sum([t.numel() * t.element_size() for t in held])
            if self._cuda:
                log.cuda_alloc_bytes[index] += torch.cuda.memory_allocated() - log.alloc[call]
        measured = floats(tensors)
        group = None
        if self._shards.raw or log.in_group[call] is not None:  # tensor parallel in sight
            group = log.group[call] = self._shards.output_group(index, log.in_group[call], measured)
        if self._activations and first_call and measured:
            row = self._evidence.row(measured, group)
            if row is not None:
                log.row_of[index] = row
        if self._nonfinite:
            log.fwd_events += (index, log.inputs[call], self._evidence.add_run([self._evidence.flag(t, group) for t in measured]))
        if self._backward:
            needing = [t for t in measured if t.requires_grad]
            if needing:
                self._grad_handles.append(on_gradients(needing, self, call, done=False))

    def backward_starts(self, call: int, grad: torch.Tensor) -> None:
        """A :class:`~layerwatch.probes.gradients.GradientHook`'s: the gradient of an output of ``call``."""
        if not is_compiling() and self.error is None and self._log.bwd_start[call] < 0:
            self._guarded(self._start_backward, call, grad)

    def _start_backward(self, call: int, grad: torch.Tensor) -> None:
        log = self._log
        log.bwd_start[call] = len(log.entered)
        if self._nonfinite and grad is not None:
            log.grad_outputs[call] = self._evidence.add_run([self._evidence.flag(grad, log.group[call])])
        module = self._ends_with_pass.pop(call, None)
        if module is not None:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._pass_done, call, module))

    def _pass_done(self, call: int, module: Any) -> None:
        """The end of the backward pass of the model's own call: its gradients are those of
        its parameters as they are now (FSDP has put its sharded ones back, with their
        gradients), flagged together (one fused norm per device)."""
        if not is_compiling() and self.error is None and self._log.bwd_start[call] >= 0:
            model = module()
            grads = [] if model is None else gradients_of(model)
            self._guarded(self._finish_backward, call, grads, True)  # fused

    def backward_done(self, call: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """A :class:`~layerwatch.probes.gradients.GradientHook`'s: the gradients of ``call``'s inputs."""
        if not is_compiling() and self.error is None and self._log.bwd_start[call] >= 0:
            self._guarded(self._finish_backward, call, grads)

    def _finish_backward(self, call: int, grads: Sequence[Optional[torch.Tensor]], fused: bool = False) -> None:
        log = self._log
        index = log.module[call]
        log.bwd_spans += (index, log.bwd_start[call], len(log.entered))
        log.bwd_start[call] = -1
        if self._nonfinite:
            grads = floats([g for g in grads if g is not None])
            group = log.in_group[call]
            flags = self._evidence.flag_together(grads) if fused else [self._evidence.flag(g, group) for g in grads]
            log.bwd_events += (index, log.grad_outputs[call], self._evidence.add_run(flags))

