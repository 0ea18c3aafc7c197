"""Runtime probes: per-module time, memory, activations and NaN/Inf on one sampled step.

A ``RuntimeProbe`` exists only between the opening and the closing of a sampled step.
It hooks every selected module (containers and leaves alike):

* forward pre/post hooks time each call, count the bytes it returns, reduce its
  outputs (``stats.reduce``, one row per distinct tensor; the histogram of a large
  output from a sample of ``HISTOGRAM_VALUES`` values) and flag NaN/Inf in its
  inputs and outputs;
* tensor hooks, never full backward hooks (an in-place op after a module breaks
  those), mark its backward: a hook on its outputs fires when the gradient with
  respect to them is ready (its backward starts), a multi-grad hook on its inputs
  (or, when no input needs a gradient, its parameters) fires when its backward is
  done;
* ``saved_tensors_hooks`` around each outermost forward count the storages autograd
  keeps for backward, once each, parameters excluded, for every module running.

Hooks only record clock marks and enqueue device work: nothing is read on the host
until :meth:`RuntimeProbe.result`, after the step. Every hook's own duration is one
interval on the same clock, and a module's time is its span minus the intervals of
the hooks nested in it, so the probes' work never counts as the model's. Times come
from ``time.perf_counter_ns`` on the CPU and from CUDA events on a GPU.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import time
from time import perf_counter_ns
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.failures import FailurePolicy
from layerwatch.hooks import FailedForwardGuard, ForwardHooks, detached, entered_by_its_own_hook, is_compiling
from layerwatch.rankings import ROOT  # the model itself: named_modules() names it ""
from layerwatch.sentinel import fused_norms
from layerwatch.structure import StructureProbe, Summary, _tensors

PROBE_FAMILIES = ("latency", "memory", "activations", "nonfinite")
# An output of up to this many values is copied in its hook and measured after the step with
# all the others (one batched reduction); a larger one gets its statistics from a few
# whole-tensor ops in the hook and its histogram from a strided sample of this many values.
HISTOGRAM_VALUES = S.HISTOGRAM_VALUES
STASH_VALUES = 1 << 22  # the buffer the copies of one step go to (16 MiB of float32, on any device)

ModuleFilter = Sequence[Union[str, type]]


def probe_name(name: str) -> str:
    return name or ROOT


def select_modules(model: nn.Module, modules: Optional[ModuleFilter]) -> list[tuple[str, nn.Module]]:
    """The modules to probe: every one, or those whose name matches a glob pattern or
    whose type is one of the given types."""
    named = list(model.named_modules())
    if modules is None:
        return named
    patterns = [m for m in modules if isinstance(m, str)]
    types = tuple(m for m in modules if isinstance(m, type))
    return [
        (name, module)
        for name, module in named
        if isinstance(module, types) or any(fnmatch.fnmatchcase(probe_name(name), p) for p in patterns)
    ]


def check_module_filter(modules: Any) -> Optional[tuple[Union[str, type], ...]]:
    """Validate the ``modules=`` option: None, or a collection of glob patterns and module types."""
    if modules is None:
        return None
    if isinstance(modules, (str, type)):
        modules = (modules,)
    chosen = tuple(modules)
    if not chosen:
        raise ValueError("modules must name at least one pattern or type (or be None for every module)")
    for item in chosen:
        if isinstance(item, type):
            if not issubclass(item, nn.Module):
                raise TypeError(f"modules: {item.__name__} is not an nn.Module subclass")
        elif not isinstance(item, str) or not item:
            raise TypeError(f"modules: each entry must be a name pattern or an nn.Module type, got {item!r}")
    return chosen


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a part of it runs under torch.compile (module hooks would not
    see inside the compiled graph, and adding them forces a recompile)."""
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


@dataclass
class ModuleTrace:
    """One module's measurements on a sampled step (host values)."""

    name: str
    calls: int = 0
    # None where the family is off (or, for bwd_ms, where no backward was seen).
    fwd_ms: Optional[float] = None
    bwd_ms: Optional[float] = None
    activation_bytes: Optional[int] = None
    saved_bytes: Optional[int] = None
    cuda_alloc_bytes: Optional[int] = None
    nonfinite: Optional[bool] = None
    activation_row: Optional[np.ndarray] = None  # stats row of its first call's outputs


@dataclass
class Offender:
    """The first module whose inputs were finite and whose outputs were not."""

    name: str
    phase: str  # "forward" or "backward"

    def describe(self, step: int) -> str:
        what = "output" if self.phase == "forward" else "gradient with respect to its inputs (or parameters)"
        given = "inputs" if self.phase == "forward" else "gradient with respect to its outputs"
        return f"step {step}, {self.phase}: {self.name} turned finite {given} into a non-finite {what}"


@dataclass
class ProbeResult:
    modules: list[ModuleTrace]  # the modules called during the step, in model order
    offender: Optional[Offender]


class _HostClock:
    def mark(self) -> int:
        return time.perf_counter_ns()

    def resolve(self, marks: list[Any]) -> np.ndarray:
        return np.asarray(marks, dtype=np.float64) / 1e6


class _CudaClock:
    """CUDA events recorded in hooks; read once, after the step. The events are kept from one
    sampled step to the next (``events``): a hook records the next one and keeps its number,
    where a new event per mark cost a driver call and an object for the garbage collector."""

    def __init__(self, events: list[Any], make: Optional[Callable[[], Any]] = None) -> None:
        self._events = events
        self._make = make or functools.partial(torch.cuda.Event, enable_timing=True)
        self._used = 0

    def mark(self) -> int:
        index = self._used
        if index == len(self._events):
            self._events.append(self._make())
        self._events[index].record()
        self._used += 1
        return index

    def resolve(self, marks: list[int]) -> np.ndarray:
        if not marks:
            return np.zeros(0)
        events = self._events
        events[marks[-1]].synchronize()
        base = events[marks[0]]
        return np.array([0.0] + [base.elapsed_time(events[m]) for m in marks[1:]])


class _FlagSlots:
    """The NaN/Inf evidence of the tensors the hooks flag, one device value each, written into
    buffers kept from step to step: a tensor's sum, not finite exactly when the tensor holds
    a NaN or Inf (see :func:`_nonfinite_sum`). A tensor
    object kept per flag would leave thousands of objects for the garbage collector to walk
    on every collection of the step."""

    SIZE = 1024

    def __init__(self, workspace: S.Workspace) -> None:
        self._workspace = workspace
        self._devices: list[torch.device] = []
        self._buffers: list[list[torch.Tensor]] = []  # per device
        self._used: list[int] = []  # per device
        self._device_of: list[int] = []  # per slot
        self._local: list[int] = []  # per slot: its position in its device's buffers

    def add(self, value: torch.Tensor) -> int:
        """A new slot holding the 0-d ``value`` (copied on its device, no host sync)."""
        device = value.device
        if device in self._devices:
            d = self._devices.index(device)
        else:
            d = len(self._devices)
            self._devices.append(device)
            self._buffers.append([])
            self._used.append(0)
        buffers, local = self._buffers[d], self._used[d]
        self._used[d] += 1
        if local == len(buffers) * self.SIZE:
            buffers.append(self._workspace.get(device, torch.float64, self.SIZE, f"flags{len(buffers)}", exact=True))
        buffers[local // self.SIZE][local % self.SIZE] = value
        self._device_of.append(d)
        self._local.append(local)
        return len(self._local) - 1

    def pieces(self) -> list[torch.Tensor]:
        """The used values of each device, to bring to the host with other pieces."""
        return [torch.cat(buffers)[:n] for buffers, n in zip(self._buffers, self._used)]

    def flagged(self, host_pieces: Sequence[np.ndarray]) -> np.ndarray:
        """Per slot, from the host copies of :meth:`pieces`: whether its tensor held a NaN or Inf."""
        values = np.array([host_pieces[d][local] for d, local in zip(self._device_of, self._local)], dtype=np.float64)
        return ~np.isfinite(values)


class _Outputs:
    """The statistics rows of the measured outputs of one step, all made after it.

    A hook does the least it can: an output of up to ``HISTOGRAM_VALUES`` values is copied
    (one op) into a stash kept from step to step; a larger one gets its count of finite
    values, min, max, sum and norm from a few whole-tensor ops (read at once on the CPU, where
    reading a value is no sync), and a strided sample, then those extremes, copied into the
    stash for its histogram. Either way its row's NONFINITE column flags it. After the step one batched
    :func:`~layerwatch.stats.reduce` measures the copies and the samples together.
    """

    def __init__(self, bins: int, zeros: bool, centered: bool, workspace: S.Workspace) -> None:
        self.bins, self.zeros, self.centered, self.workspace = bins, zeros, centered, workspace
        # Per row: where its values are in the stash, or -1 and the tensor in ``kept``
        # (ints, not one view per row: fewer objects alive for the garbage collector).
        self._offset: list[int] = []
        self._length: list[int] = []
        self.kept: dict[int, torch.Tensor] = {}  # row -> a clone or a sample
        self.exact: dict[int, tuple[torch.Tensor | np.ndarray, int]] = {}  # row -> (statistics from the hook, values)
        self._stash: Optional[torch.Tensor] = None  # where copies go: a buffer kept from step to step
        self._used = 0

    def _keep(self, flat: torch.Tensor, copy: bool, extremes: Optional[torch.Tensor] = None) -> int:
        """A new row for ``flat`` (then ``extremes``, when given): copied into the stash (freeing
        hundreds of small copies after every sample made the next step fault their pages back
        in), or kept (cloned when ``copy``) when it is full or on another device."""
        row, n = len(self._offset), flat.numel() + (0 if extremes is None else extremes.numel())
        if copy and self._stash is None:
            self._stash = self.workspace.get(flat.device, torch.float32, STASH_VALUES, "outputs")
        if copy and self._stash.device == flat.device and self._used + n <= self._stash.numel():
            self._stash[self._used : self._used + flat.numel()].copy_(flat)
            if extremes is not None:
                self._stash[self._used + flat.numel() : self._used + n].copy_(extremes)
            self._offset.append(self._used)
            self._used += n
        else:
            self.kept[row] = (flat.clone() if copy else flat) if extremes is None else torch.cat([flat, extremes.to(flat)])
            self._offset.append(-1)
        self._length.append(n)
        return row

    def add(self, t: torch.Tensor) -> int:
        """Record ``t``; its row (whose NONFINITE column flags it)."""
        flat = S.as_real_values(t)
        n = flat.numel()
        if n <= HISTOGRAM_VALUES:
            return self._keep(flat, copy=True)
        sample = flat[:: S.prime_stride(n, HISTOGRAM_VALUES)]
        stats, extremes = self._read_at_once(flat) if flat.device.type == "cpu" else self._masked(flat)
        row = self._keep(sample, copy=True, extremes=extremes)
        self.exact[row] = (stats, n)
        return row

    def _read_at_once(self, flat: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """``[finite count, min, max, sum, norm, (non-zeros), (variance)]`` of the finite values,
        read on the host (no device sync on the CPU), and the extremes as a tensor."""
        values, finite = [float(v) for v in self._statistics(flat)], flat.numel()
        if not math.isfinite(values[2] + values[3]):  # statistics over the finite values, as for every other tensor
            flat = flat[torch.isfinite(flat)]
            values, finite = [float(v) for v in self._statistics(flat)], flat.numel()
        return np.array([finite] + values), torch.tensor(values[:2])

    def _masked(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics of :meth:`_read_at_once` by masked ops, on the device: correct for any
        value, nothing read on the host."""
        finite_mask = torch.isfinite(flat)
        values = self._statistics(torch.where(finite_mask, flat, torch.zeros((), dtype=flat.dtype, device=flat.device)),
                                  variance=False)
        values[0] = torch.where(finite_mask, flat, math.inf).amin()
        values[1] = torch.where(finite_mask, flat, -math.inf).amax()
        finite = finite_mask.sum(dtype=torch.float64)
        if self.centered:  # the variance of the finite values alone, not of the zeros in place of the others
            dev = torch.where(finite_mask, flat - (values[2] / finite.clamp(min=1)).to(flat.dtype), 0.0)
            values.append(torch.dot(dev, dev) / finite.clamp(min=1))
        return torch.cat([finite.view(1), torch.stack(values).double()]), torch.stack(values[:2])

    def _statistics(self, flat: torch.Tensor, variance: bool = True) -> list[torch.Tensor]:
        """min, max, sum, norm (and non-zeros, variance when asked and ``variance``) of ``flat``,
        device scalars; no value (all were NaN/Inf): min inf, max -inf, variance NaN."""
        empty = flat.numel() == 0  # every value was NaN/Inf
        parts = [flat.new_tensor(math.inf) if empty else flat.amin(), flat.new_tensor(-math.inf) if empty else flat.amax(),
                 flat.sum(), torch.dot(flat, flat).sqrt()]  # dot: faster than vector_norm on the CPU, and closer
        if self.zeros:
            parts.append(torch.count_nonzero(flat))
        if self.centered and variance:
            parts.append(flat.new_tensor(math.nan) if empty else torch.var(flat, correction=0))
        return parts

    def rows(self, extra: list[torch.Tensor]) -> tuple[list[np.ndarray], np.ndarray]:
        """The ``extra`` pieces and every row, on the host (one transfer per device)."""
        if not self._offset:
            return S.to_host(extra), np.empty((0, S.row_width(self.bins)))
        values = [self.kept[row] if offset < 0 else self._stash[offset : offset + n]
                  for row, (offset, n) in enumerate(zip(self._offset, self._length))]
        device_rows = S.reduce(values, self.bins, zeros=self.zeros, centered=self.centered, workspace=self.workspace)
        on_device = [stats for stats, _ in self.exact.values() if isinstance(stats, torch.Tensor)]  # else read by the hook
        host = S.to_host(extra + [device_rows] + on_device)
        extra_host, rows, device_host = host[: len(extra)], host[len(extra)], iter(host[len(extra) + 1 :])
        rows = rows.reshape(len(values), -1)
        for row, (stats, n) in self.exact.items():
            stats = next(device_host) if isinstance(stats, torch.Tensor) else stats
            finite = stats[0]
            rows[row, S.HIST :] *= finite / max(rows[row, S.COUNT], 1.0)  # the sample stands for every value
            rows[row, S.COUNT], rows[row, S.NONFINITE] = finite, n - finite
            rows[row, [S.MIN, S.MAX, S.SUM]] = stats[1:4]
            rows[row, S.SUMSQ] = stats[4] ** 2
            extra_stats = list(stats[5:])
            rows[row, S.ZEROS] = finite - extra_stats.pop(0) if self.zeros else np.nan
            rows[row, S.CENTERED_SUMSQ] = extra_stats.pop(0) * finite if self.centered else np.nan
        return extra_host, rows


class RuntimeProbe:
    """Hooks on the selected modules for one sampled step; ``remove()`` is safe twice.

    A hook that fails records the error and the probe goes quiet; it never raises into
    the training step. Forwards with autograd off (validation) and recomputes inside
    backward (activation checkpointing) are not recorded.

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
    ) -> None:
        self.error: Optional[BaseException] = None
        self.compiled = False  # a hook was traced by Dynamo: the model runs inside compiled code
        self.inert = False  # hooks left in place only so that compiled code keeps its guards
        self._host_ns = 0
        self._latency = "latency" in families
        self._memory = "memory" in families
        self._activations = "activations" in families
        self._nonfinite = "nonfinite" in families
        self._backward = self._latency or self._nonfinite
        self._bins, self._zeros, self._centered = bins, zeros, centered
        device = next((p.device for p in parameters), torch.device("cpu"))
        self._cuda = device.type == "cuda"
        self._clock: Any = _CudaClock([] if cuda_events is None else cuda_events) if self._cuda else _HostClock()
        self._names = [probe_name(name) for name, _ in modules]
        self._index = {id(module): index for index, (_, module) in enumerate(modules)}
        count = len(modules)
        self._calls = [0] * count  # per module
        self._activation_bytes = [0] * count
        self._saved_bytes = [0] * count
        self._cuda_alloc_bytes = [0] * count
        self._param_storages = {_storage_key(p) for p in parameters} if self._memory else set()
        self._saved_storages: set[int] = set()
        self._saved_context: Any = None
        self._saved_versions = _SavedVersions()
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
        self._stack: list[int] = []  # the calls whose forward is running
        # Outermost calls whose inputs need no gradient, and the parameters they train
        self._ends_with_pass: dict[int, list[nn.Parameter]] = {}
        self._ignored_depth = 0
        # Hook intervals: marks at entry and exit of every hook, in firing order.
        self._entered: list[Any] = []
        self._left: list[Any] = []
        self._fwd_spans: list[int] = []  # (module, start interval, end interval) after each other
        self._bwd_spans: list[int] = []
        # Flags: an entry per distinct tensor seen, >= 0 a slot of ``_slots``, < 0 the row
        # ``-1 - entry`` (whose NONFINITE column says it). Runs of entries: a length, then them.
        workspace = workspace if workspace is not None else S.Workspace()
        self._slots = _FlagSlots(workspace)
        self._flags: list[int] = []
        self._runs: list[int] = []
        self._fwd_events: list[int] = []  # (module, inputs run, outputs run) after each other
        self._bwd_events: list[int] = []
        self._outputs = _Outputs(bins, zeros, centered, workspace)
        self._row_of: dict[int, int] = {}  # module -> row
        # id(tensor) -> a weak reference, and its version, flag and row packed in one int
        self._seen_ref: dict[int, Any] = {}
        self._seen_key: dict[int, int] = {}
        self._grad_handles: list[Any] = []
        self._handles: list[Any] = [ForwardHooks([module for _, module in modules], self._pre_hook, self._post_hook)]

    # ------------------------------------------------------------------ lifecycle

    def remove(self) -> None:
        for handle in self._handles + self._grad_handles:
            handle.remove()
        self._handles, self._grad_handles = [], []
        self._exit_saved_context()
        self._stack = []
        self._seen_ref, self._seen_key = {}, {}
        self._ends_with_pass = {}

    def result(self) -> ProbeResult:
        """The step's measurements: one host transfer for every flag and stats row."""
        self.remove()
        slot_pieces, rows_host = self._outputs.rows(self._slots.pieces())
        flagged = self._slots.flagged(slot_pieces)
        nonfinite = [bool(rows_host[-1 - f, S.NONFINITE] > 0) if f < 0 else bool(flagged[f]) for f in self._flags]
        marks = self._clock.resolve([m for pair in zip(self._entered, self._left) for m in pair])
        entered, left = marks[0::2], marks[1::2]
        # nested[k]: time spent in hooks 0..k-1; a span subtracts the hooks inside it.
        nested = np.concatenate([[0.0], np.cumsum(left - entered)])
        traces = [ModuleTrace(name) for name in self._names]
        for index, trace in enumerate(traces):
            trace.calls = self._calls[index]
            if self._memory:
                trace.activation_bytes, trace.saved_bytes = self._activation_bytes[index], self._saved_bytes[index]
                trace.cuda_alloc_bytes = self._cuda_alloc_bytes[index] if self._cuda else None
            if self._nonfinite:
                trace.nonfinite = False
        for spans, attribute in ((self._fwd_spans, "fwd_ms"), (self._bwd_spans, "bwd_ms")) if self._latency else ():
            for index, start, end in zip(spans[0::3], spans[1::3], spans[2::3]):
                trace = traces[index]
                ms = max(entered[end] - left[start] - (nested[end] - nested[start + 1]), 0.0)
                setattr(trace, attribute, (getattr(trace, attribute) or 0.0) + ms)
        for index, row in self._row_of.items():
            traces[index].activation_row = rows_host[row]
        offender = None
        if self._nonfinite:
            for events, phase in ((self._fwd_events, "forward"), (self._bwd_events, "backward")):
                for index, inputs, outputs in zip(events[0::3], events[1::3], events[2::3]):
                    bad_out = any(nonfinite[f] for f in self._run(outputs))
                    trace = traces[index]
                    trace.nonfinite = trace.nonfinite or bad_out
                    if offender is None and bad_out and not any(nonfinite[f] for f in self._run(inputs)):
                        offender = Offender(trace.name, phase)
        return ProbeResult([t for t in traces if t.calls], offender)

    # ------------------------------------------------------------------ hooks
    # Hooks hold the probe (names and indices), never a module or the inspector.

    # A module this probe does not know (a deep copy of a probed one, made mid-step, carries
    # its hooks) is passed over.

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if is_compiling():  # traced: note it (a store Dynamo replays), nothing else
            self.compiled = True
            return
        index = self._index.get(id(module))
        if index is not None and self.error is None and not self.inert:
            self._guarded(self._enter, index, args, module)

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
            self._exit_saved_context()

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
            self._exit_saved_context()
        self._entered.append(entered if device_mark is None else device_mark)
        self._left.append(perf_counter_ns() if device_mark is None else self._clock.mark())
        if device_mark is not None:
            self._host_ns += perf_counter_ns() - entered
        else:
            self._host_ns += self._left[-1] - entered

    @property
    def hook_seconds(self) -> float:
        """Host time spent in the hooks so far (the probes' own cost)."""
        return self._host_ns / 1e9

    def _enter(self, index: int, args: tuple, module: nn.Module) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute inside backward
        if self._ignored_depth or (not self._stack and not torch.is_grad_enabled()):
            self._ignored_depth += 1
            return
        if not self._stack and self._memory:
            self._enter_saved_context()
        tensors = list(args) if len(args) == 1 and type(args[0]) is torch.Tensor else list(_tensors(args))
        call = len(self._call_module)
        self._call_module.append(index)
        self._call_start.append(len(self._entered))
        self._call_inputs.append(self._add_run([self._flag(t) for t in tensors if _is_float(t)]) if self._nonfinite else -1)
        self._call_alloc.append(torch.cuda.memory_allocated() if self._memory and self._cuda else 0)
        self._call_bwd_start.append(-1)
        self._call_grad_outputs.append(-1)
        if self._backward and torch.is_grad_enabled():
            watched = [t for t in tensors if t.requires_grad]
            if watched:
                self._grad_handles.append(_on_gradients(watched, self, call, done=True))
            elif not self._stack:  # the model itself: its backward ends with the pass (a hook per parameter would not)
                self._ends_with_pass[call] = [p for p in module.parameters() if p.requires_grad]
            else:
                watched = [p for p in module.parameters() if p.requires_grad]
                if watched:
                    self._grad_handles.append(_on_gradients(watched, self, call, done=True))
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
        tensors = [output] if type(output) is torch.Tensor else list({id(t): t for t in _tensors(output)}.values())
        if self._memory:
            self._activation_bytes[index] += sum(t.numel() * t.element_size() for t in tensors)
            if self._cuda:
                self._cuda_alloc_bytes[index] += torch.cuda.memory_allocated() - self._call_alloc[call]
        measured = [t for t in tensors if _is_float(t)]
        if self._activations and first_call and measured:
            self._row_of[index] = self._row(measured)
        if self._nonfinite:
            self._fwd_events += (index, self._call_inputs[call], self._add_run([self._flag(t) for t in measured]))
        if self._backward:
            needing = [t for t in measured if t.requires_grad]
            if needing:
                self._grad_handles.append(_on_gradients(needing, self, call, done=False))

    def _backward_starts(self, call: int, grad: torch.Tensor) -> None:
        if not is_compiling() and self.error is None and self._call_bwd_start[call] < 0:
            self._guarded(self._start_backward, call, grad)

    def _start_backward(self, call: int, grad: torch.Tensor) -> None:
        self._call_bwd_start[call] = len(self._entered)
        if self._nonfinite and grad is not None:
            self._call_grad_outputs[call] = self._add_run([self._flag(grad)])
        parameters = self._ends_with_pass.pop(call, None)
        if parameters is not None:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._pass_done, call, parameters))

    def _pass_done(self, call: int, parameters: list[nn.Parameter]) -> None:
        """The end of the backward pass of the model's own call: its gradients are those of
        its parameters, flagged together (one fused norm per device)."""
        if not is_compiling() and self.error is None and self._call_bwd_start[call] >= 0:
            self._guarded(self._finish_backward, call, [p.grad for p in parameters], True)  # fused

    def _backward_done(self, call: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        if not is_compiling() and self.error is None and self._call_bwd_start[call] >= 0:
            self._guarded(self._finish_backward, call, grads)

    def _finish_backward(self, call: int, grads: Sequence[Optional[torch.Tensor]], fused: bool = False) -> None:
        index = self._call_module[call]
        self._bwd_spans += (index, self._call_bwd_start[call], len(self._entered))
        self._call_bwd_start[call] = -1
        if self._nonfinite:
            grads = [g for g in grads if g is not None and _is_float(g)]
            flags = self._flag_together(grads) if fused else [self._flag(g) for g in grads]
            self._bwd_events += (index, self._call_grad_outputs[call], self._add_run(flags))

    # ------------------------------------------------------------------ tensors

    def _add_run(self, flags: list[int]) -> int:
        """Where a run of flag entries starts in ``_runs``."""
        start = len(self._runs)
        self._runs.append(len(flags))
        self._runs += flags
        return start

    def _run(self, start: int) -> list[int]:
        """The flag entries of the run at ``start`` (none for -1)."""
        return [] if start < 0 else self._runs[start + 1 : start + 1 + self._runs[start]]

    def _flag(self, t: torch.Tensor) -> int:
        """The entry of the flag that holds whether ``t`` has a NaN or Inf."""
        seen = self._seen(t)
        if seen is not None:
            return seen[0]
        self._flags.append(self._slots.add(_nonfinite_sum(t.detach())))
        self._remember(t, len(self._flags) - 1, None)
        return len(self._flags) - 1

    def _flag_together(self, tensors: list[torch.Tensor]) -> list[int]:
        """Flag entries, one per device and dtype, that say whether any of ``tensors`` has a NaN
        or Inf: the sum of their fused norms (:func:`~layerwatch.sentinel.fused_norms`). An L2
        norm overflows float32 from ~1.8e19 (a GradScaler's first steps reach that), an L1 norm
        only from ~3.4e38 but is twice as slow on the CPU: there the L2 norm goes first, and a
        group whose L2 norm is not finite is measured again in L1 (reading it is no sync)."""
        first = len(self._flags)
        on_cpu = all(t.device.type == "cpu" for t in tensors)
        for indices, norms in fused_norms(tensors, ord=2 if on_cpu else 1):
            total = norms.sum()
            if on_cpu and not math.isfinite(float(total)):
                ((_, norms),) = fused_norms([tensors[i] for i in indices], ord=1)
                total = norms.sum()
            self._flags.append(self._slots.add(total))
        return list(range(first, len(self._flags)))

    def _row(self, tensors: list[torch.Tensor]) -> int:
        """A stats row of the values of ``tensors`` together, shared with an identical earlier
        row (a container returning its last child's output)."""
        t = tensors[0]
        seen = self._seen(t) if len(tensors) == 1 else None
        if seen is not None and seen[1] is not None:
            return seen[1]
        values = t if len(tensors) == 1 else torch.cat([S.as_real_values(x) for x in tensors])
        row = self._outputs.add(values)
        if len(tensors) == 1:
            self._flags.append(-1 - row)
            self._remember(t, len(self._flags) - 1, row)
        return row

    def _seen(self, t: torch.Tensor) -> Optional[tuple[int, Optional[int]]]:
        """(flag entry, row or None) of ``t`` when this very tensor, unchanged since, was seen."""
        key = self._seen_key.get(id(t))
        if key is None or self._seen_ref[id(t)]() is not t or key >> 64 != t._version:
            return None
        row = key & 0xFFFFFFFF
        return (key >> 32) & 0xFFFFFFFF, (row - 1 if row else None)

    def _remember(self, t: torch.Tensor, flag: int, row: Optional[int]) -> None:
        try:
            self._seen_ref[id(t)] = weakref.ref(t)
        except TypeError:  # a tensor type without weak references: not shared
            return
        self._seen_key[id(t)] = (t._version << 64) | (flag << 32) | (0 if row is None else row + 1)

    # ------------------------------------------------------------------ saved tensors

    def _enter_saved_context(self) -> None:
        outer = _enclosing_saved_tensors_hooks()
        if outer is None:
            context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._saved_versions.unpack)
        else:  # the user's hooks (an offload, say) still pack every saved tensor; the probe only counts
            outer_pack, outer_unpack = outer
            context = torch.autograd.graph.saved_tensors_hooks(lambda t: outer_pack(self._count_saved(t)), outer_unpack)
        context.__enter__()
        self._saved_context = context

    def _exit_saved_context(self) -> None:
        context, self._saved_context = self._saved_context, None
        if context is not None:
            context.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count_saved(t)
        # Returning ``t`` itself would make a reference cycle through its grad_fn that keeps
        # activations alive; a detached alias shares its storage and version counter, and
        # the version keeps autograd's check against in-place changes of saved tensors.
        alias = t.detach()
        self._saved_versions.versions[id(alias)] = t._version
        return alias

    def _count_saved(self, t: torch.Tensor) -> torch.Tensor:
        """Adds the storage of ``t``, saved for backward, to the modules running (once per storage)."""
        if self._stack and self.error is None:
            try:
                key = _storage_key(t)
                if key not in self._param_storages and key not in self._saved_storages:
                    self._saved_storages.add(key)
                    nbytes = t.untyped_storage().nbytes()
                    for index in dict.fromkeys(self._call_module[call] for call in self._stack):
                        self._saved_bytes[index] += nbytes
            except Exception:  # a tensor without a storage (a subclass, meta): not counted
                pass
        return t


class _GradientHook:
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


def _on_gradients(tensors: list[torch.Tensor], probe: "RuntimeProbe", call: int, done: bool) -> Any:
    """A :class:`_GradientHook` on ``tensors``: a multi-grad hook (any of them for a start, all
    of them for a done); for one tensor (most modules) its plain tensor hook, which fires at
    the same moment and allocates a tenth of the objects."""
    hook = _GradientHook(probe, call, done)
    if len(tensors) > 1:
        return torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="all" if done else "any")
    return tensors[0].register_hook(hook)


class _SavedVersions:
    """The version each tensor saved for backward had when it was saved, by the id of the alias
    kept in its place (an int in a dict, not a tuple per saved tensor), for autograd's check
    against in-place changes. The graph holds this, not the probe."""

    __slots__ = ("versions",)

    def __init__(self) -> None:
        self.versions: dict[int, int] = {}

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        version = self.versions.get(id(t))
        if version is not None and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a {tuple(t.shape)} {t.dtype} tensor is at version {t._version}; expected version {version}"
            )
        return t


def _enclosing_saved_tensors_hooks() -> Optional[tuple[Callable, Callable]]:
    """The (pack, unpack) hooks of the innermost ``saved_tensors_hooks`` context the forward runs
    in (``save_on_cpu``, say), or None. Torch has no public reader of them, and its private one
    came with torch 2.8 (taking no argument in some builds); without it the probe's own hooks
    stand in for the user's during a sampled forward."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(False)
    except TypeError:
        return top()


def _storage_key(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts (without making the storage's Python object, which stays)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _nonfinite_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s values, a device scalar: not finite exactly when ``t`` holds a NaN or
    Inf. One read pass, several times cheaper than ``isfinite(t).all()``; finite values whose
    float32 sum overflows (beyond ~3e38) read as non-finite."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()


def _is_float(t: torch.Tensor) -> bool:
    """A dense floating (or complex) tensor: one whose values can be NaN and can be reduced."""
    return t.layout == torch.strided and (t.is_floating_point() or t.is_complex())


class StepProbes:
    """The module hooks of one sampled step: the layer table (the first time) and the
    runtime probes. Neither is armed on a compiled model (hooks would force a recompile
    and see nothing inside the graph); that is said once.

    A model called from compiled code (``torch.compile`` of a function that calls it) is
    found when Dynamo traces the first armed hooks. Those hooks then stay, inert, until
    :meth:`remove`: compiled code is guarded on the model's hooks, so removing them at the
    end of the step, or arming new ones later, would recompile it."""

    def __init__(self, families: Sequence[str], modules: Optional[ModuleFilter], stats: Sequence[str], bins: int,
                 failures: FailurePolicy) -> None:
        self.families, self.modules, self.bins, self.failures = families, modules, bins, failures
        self.zeros, self.centered = "zero_frac" in stats, "std" in stats
        self.structure_pending = "structure" in families
        self.runtime_on = any(family in families for family in PROBE_FAMILIES)
        self._structure: Optional[StructureProbe] = None
        self._runtime: Optional[RuntimeProbe] = None
        self._forward_guard: Optional[FailedForwardGuard] = None
        self._inert: list[Any] = []
        self.workspace = S.Workspace()  # kept from one sampled step to the next
        self._cuda_events: list[Any] = []  # the runtime probes' clock marks on a GPU, idem

    def arm(self, model: nn.Module, parameters: Sequence[nn.Parameter], step: int) -> None:
        if not (self.structure_pending or self.runtime_on):
            return
        if is_compiled(model):
            self.structure_pending = self.runtime_on = False
            self.failures.warn_once(
                "compiled",
                "layerwatch: the model (or part of it) is torch.compile'd; module hooks cannot see inside a compiled "
                "graph, so the layer table and the per-module families (latency, memory, activations, nonfinite) are "
                "not recorded. Parameter families and the NaN sentinel go on. For the table call "
                "layerwatch.summarize(model._orig_mod, batch).",
            )
            return
        if self.structure_pending:
            self.failures.run("record the layer table", lambda: self._arm_structure(model), step)
        if self.runtime_on:
            self.failures.run("arm the runtime probes", lambda: self._arm_runtime(model, parameters), step)
        if self._structure is not None or self._runtime is not None:
            self.failures.run("guard the forward", lambda: self._guard(model), step)

    def _guard(self, model: nn.Module) -> None:
        # The model's forward raised: nothing of this step stays on the model (the exception
        # may leave the training loop, and nothing may come to disarm the step), and the step
        # is not measured.
        self._forward_guard = FailedForwardGuard(model, self.disarm)

    def _arm_structure(self, model: nn.Module) -> None:
        self._structure = StructureProbe(model, training_only=True)

    def _arm_runtime(self, model: nn.Module, parameters: Sequence[nn.Parameter]) -> None:
        modules = select_modules(model, self.modules)
        if not modules:
            self.runtime_on = False
            self.failures.warn_once(
                "no-modules", f"layerwatch: modules={list(self.modules or ())!r} matches no module of the model; "
                "the per-module families are off",
            )
            return
        families = self.families
        if self._structure is not None:  # FlopCounterMode slows every op of this step: its times would mislead
            families = tuple(f for f in families if f != "latency")
        self._runtime = RuntimeProbe(
            modules, families=families, bins=self.bins, zeros=self.zeros, centered=self.centered, parameters=parameters,
            workspace=self.workspace, cuda_events=self._cuda_events,
        )

    @property
    def hook_seconds(self) -> float:
        """Host time the runtime probes' hooks have spent so far this step."""
        return 0.0 if self._runtime is None else self._runtime.hook_seconds

    def disarm(self) -> None:
        """Remove this step's hooks (not the inert ones)."""
        for probe in (self._structure, self._runtime, self._forward_guard):
            if probe is not None:
                probe.remove()
        self._structure = self._runtime = self._forward_guard = None

    def remove(self) -> None:
        """Remove every hook, the inert ones too (the engine is finishing)."""
        self.disarm()
        for probe in self._inert:
            probe.remove()
        self._inert = []

    def take(self) -> tuple[Optional[Summary], Optional[ProbeResult]]:
        """Remove the hooks; the layer table (when a whole forward was seen) and the runtime
        measurements (when no probe failed)."""
        structure, runtime = self._structure, self._runtime
        armed = [probe for probe in (structure, runtime) if probe is not None]
        if any(probe.compiled for probe in armed):
            for probe in armed:
                probe.inert = True
            self._inert += armed
            if self._forward_guard is not None:  # compiled code is guarded on forward too
                self._inert.append(self._forward_guard)
            self._structure = self._runtime = self._forward_guard = None
            self.structure_pending = self.runtime_on = False
            self.failures.warn_once(
                "compiled-caller",
                "layerwatch: the model runs inside compiled code (torch.compile of a function that calls it), where "
                "module hooks do not run; the layer table and the per-module families (latency, memory, "
                "activations, nonfinite) are not recorded. Parameter families and the NaN sentinel go on.",
            )
            return None, None
        self.disarm()
        summary = result = None
        if structure is not None:
            if structure.error is not None:
                self.structure_pending = False
                self.failures.warn_once("fail:structure", f"layerwatch: could not record the layer table: {structure.error!r}; skipped")
            elif structure.windows:
                summary = structure.summary()
                self.structure_pending = False
        if runtime is not None:
            if runtime.error is None:
                try:
                    result = runtime.result()
                except Exception as e:
                    runtime.error = e

            if runtime.error is not None:
                self.runtime_on = False
                self.failures.warn_once("fail:probes", f"layerwatch: a runtime probe failed: {runtime.error!r}; the per-module families are off")
        return summary, result
