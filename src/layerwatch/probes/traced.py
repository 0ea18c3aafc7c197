"""The traced probe: per-module measurements made inside compiled code.

Module hooks that Dynamo traces become part of the compiled graph. A :class:`TracedProbe`'s
hook starts with a plain Python bool, ``armed``: Dynamo guards on it, so compiled code has
two variants, the one it would have without layerwatch (unarmed, every step between samples)
and the armed one (sampled steps), and switches between them with no recompile. Armed, the
hook adds one node per module call to the graph, an opaque operator (:data:`measure_call`)
whose Python body compiled code runs eagerly with the real tensors: the eager probes' own
work, a copy of the output (or of a sample of it) into the stash of
:class:`~layerwatch.probes.outputs.Outputs` and the NaN/Inf evidence of its inputs and outputs,
all enqueued device work. One batched reduction after the step makes the rows, and one
transfer brings them to the host (:meth:`TracedProbe.result`). In backward, the NaN/Inf
values of the gradients of a module's output and of its input are counted by an identity
autograd function the armed hooks pass them through (:class:`GradientCount`); nothing armed
draws a random number, so a sampled step's dropout masks are the unsampled step's.

Compiled code keeps the hooks it was traced with: hooks added after the first compiled call
never run (Dynamo does not guard on them, ``skip_nnmodule_hook_guards``), and removing them
would not stop them either. So these hooks are attached once, before the first compiled
forward, and stay until the engine finishes; a sampled step whose armed hooks recorded
nothing is how a late attachment shows.

Two ways in, one probe: as the hooks of the modules inside a ``torch.compile``'d module
(:meth:`TracedProbe.attach`), or called by the eager runtime probe's hooks when Dynamo traces
them (a model called from a compiled function). Run eagerly (``set_stance("force_eager")``,
a graph break), the same operator runs, and records the same.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.failures import FailurePolicy
from layerwatch.hooks import inlined_only, tensors_in, with_first_replaced
from layerwatch.probes.compiled_attention import CompiledAttention
from layerwatch.probes.numbering import Numbering
from layerwatch.probes.outputs import Outputs, is_float, nonfinite_sum
from layerwatch.probes.runtime import ModuleTrace, Offender, ProbeResult
from layerwatch.probes.selection import probe_names
from layerwatch.probes.weights import NonfiniteWeights, WeightCheck
from layerwatch.vocabulary import PROBE_FAMILIES


class TracedProbe:
    """Gated hooks on modules that run inside compiled code; see the module's docstring."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], *, families: Sequence[str], bins: int, zeros: bool,
                 centered: bool, device: torch.device, ahead: bool = False) -> None:
        self.armed = False
        self.names = probe_names(modules)
        self.blocks = [index for index, (_, module) in enumerate(modules) if module._modules]  # those with children
        self._attention_like = {index for index, (_, module) in enumerate(modules) if "attention" in type(module).__name__.lower()}
        self._measures_attention = "attention" in families
        self.attention: Optional[CompiledAttention] = None  # SDPA's stand-in while the hooks are on
        # module -> what else measures its first output this step (TransformerProbes.arm_traced)
        self.watchers: dict[int, Callable[[torch.Tensor], None]] = {}
        self._index = {id(module): index for index, (_, module) in enumerate(modules)}
        self._activations = "activations" in families
        self._nonfinite = "nonfinite" in families
        self._memory = "memory" in families
        self._bins, self._zeros, self._centered = bins, zeros, centered
        self._workspace = S.Workspace()
        # NaN/Inf values in the gradients of each module's outputs and of its inputs, over its
        # calls: the gradient autograd accumulates into a leaf per module and side (see
        # :class:`GradientCount`).
        self._grad_outputs = [_counter(device) for _ in modules]
        self._grad_inputs = [_counter(device) for _ in modules]
        self.clock = torch.zeros(1, dtype=torch.float64, device=device)  # what the operator says it mutates
        self.low_precision = False  # a measured module's output was bfloat16 or float16 (say_once)
        self._handles: list[Any] = []
        self.number = _PROBES.add(self)  # what the operator is given: a constant of the graph
        self._clear()
        if ahead:
            self.stand_in_ahead()

    def attach(self, modules: Sequence[nn.Module]) -> None:
        """Hook ``modules`` (of those this probe was made for) until :meth:`remove`; with the
        ``attention`` family, SDPA's stand-in (:mod:`~layerwatch.probes.compiled_attention`) too."""
        if self._measures_attention and self.attention is None and measure_call is not None:
            self.attention = CompiledAttention(self, self._attention_like)
        for module in modules:
            self._handles += [module.register_forward_pre_hook(self.watch_inputs, with_kwargs=True),
                              module.register_forward_hook(self.record)]

    def stand_in_ahead(self) -> None:
        """With the ``attention`` family, the attention stand-ins before the model's first
        forward (``ahead``), for a caller that may compile it (``torch.compile`` of a function that calls
        it: nothing tells before the first sample, and what stands in after its first compile
        would cost it a graph more). They measure only where Dynamo traces them; a model that
        turns out to run eagerly has them taken off (:meth:`drop_attention`)."""
        if self._measures_attention and self.attention is None and measure_call is not None:
            self.attention = CompiledAttention(self, self._attention_like, traced_only=True)

    def drop_attention(self) -> None:
        if self.attention is not None:
            self.attention.remove()
            self.attention = None

    def index_of(self, module: nn.Module) -> Optional[int]:
        """The index of ``module`` among this probe's, or None."""
        return self._index.get(id(module))

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self.drop_attention()
        _PROBES.release(self.number)

    @property
    def calls_ended(self) -> int:
        """How many module calls ended so far this sampled step."""
        return len(self._call_module)

    def attention_calls(self) -> dict[str, list[torch.Tensor]]:
        """This step's SDPA calls inside compiled code, by module (each call's ``[heads, 3]``)."""
        return {} if self.attention is None else self.attention.by_module(self._call_module, self.names)

    def arm(self) -> None:
        """Clear what the last sampled step recorded and turn recording on."""
        self._clear()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False
        self.watchers = {}

    @property
    def hook_seconds(self) -> float:
        """The host's time in the operator's body this sampled step, while armed (no hook clock sees it)."""
        return self.host_ns / 1e9 if self.armed else 0.0

    def _clear(self) -> None:
        self._call_module: list[int] = []  # per call, in order: its module
        self.host_ns = 0  # the host's time in the operator's body
        self._evidence: list[torch.Tensor] = []  # per call: its inputs' and its outputs' nonfinite_sum
        self._calls = [0] * len(self.names)  # per module
        self._bytes = [0] * len(self.names)
        self._row_of: dict[int, int] = {}  # module -> the row of its first call's outputs
        self._outputs = Outputs(self._bins, self._zeros, self._centered, self._workspace)
        for counter in self._grad_outputs + self._grad_inputs:
            counter.grad = None
        if self.attention is not None:
            self.attention.clear()

    # ------------------------------------------------------------------ in the graph
    # No host read, no Python state changed where Dynamo traces: it would replay a mutation of
    # a list on every call, and recompile for it. The operator's body is not traced. Nothing
    # here draws a random number or registers a tensor hook: Dynamo (2.13) traces a hook on
    # an intermediate tensor as a subgraph and then lost track of attributes set on the
    # model's own new objects (transformers' KV cache), falling back to running the model's
    # forward eagerly, module by module: other graphs, other dropout masks.

    @inlined_only
    def watch_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """A forward pre-hook: the module's first input that needs a gradient, passed through
        :class:`GradientCount`, which counts the NaN/Inf values of its gradient (the module's
        backward is done)."""
        if not (self.armed and self._nonfinite and torch.is_grad_enabled()):
            return None
        index = self._index.get(id(module))
        if index is None:
            return None
        args, done = _counted(args, self._grad_inputs[index])
        if not done:
            kwargs, done = _counted(kwargs, self._grad_inputs[index])
        return (args, kwargs) if done else None

    @inlined_only
    def record(self, module: nn.Module, args: Any, output: Any) -> Any:
        """A forward hook: the call measured by one opaque operator, and the module's first
        output that needs a gradient passed through :class:`GradientCount` (its backward
        starts). Returns the output so passed, or None."""
        if not self.armed or measure_call is None:  # a torch before 2.4: nothing inside compiled code
            return None
        index = self._index.get(id(module))
        if index is None:
            return None
        done = False
        if self._nonfinite and torch.is_grad_enabled():
            output, done = _counted(output, self._grad_outputs[index])
        outputs = [t for t in tensors_in(output) if is_float(t)]
        inputs = [t for t in tensors_in(args) if is_float(t)]
        measure_call([t.detach() for t in outputs], [t.detach() for t in inputs], self.clock, self.number, index)
        return output if done else None

    def measure(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], index: int) -> None:
        """One call of module ``index``, eagerly: the operator's body, which compiled code runs.
        Device work is enqueued, nothing is read."""
        with torch.no_grad():
            self._call_module.append(index)
            none = self.clock[0] * 0
            self._evidence += [sum(map(nonfinite_sum, inputs), none), sum(map(nonfinite_sum, outputs), none)]
            if self._activations and outputs and index not in self._row_of:
                flat = outputs[0].reshape(-1) if len(outputs) == 1 else torch.cat([S.as_real_values(t) for t in outputs])
                self._row_of[index] = self._outputs.add(flat)
            watcher = self.watchers.get(index)
            if watcher is not None and outputs:
                watcher(outputs[0])
            self._bytes[index] += sum(t.numel() * t.element_size() for t in outputs)
            self.low_precision = self.low_precision or any(t.dtype in _LOW_PRECISION for t in outputs)
            self._calls[index] += 1
            self.clock.add_(1)

    # ------------------------------------------------------------------ after the step

    def result(self, weights: Optional[WeightCheck] = None) -> ProbeResult:
        """The step's measurements: one batched reduction of the outputs, then one transfer.

        The forward's first offender is the first call whose inputs were finite and whose
        outputs were not, in execution order, as in eager. In backward the graph runs as one
        node: its first offender is the module whose outputs' gradient was finite and whose
        inputs' gradient was not, latest in the forward's order (the backward's order wherever
        a module's gradient depends on the modules after it). A module computing with a weight
        that was non-finite already (``weights``) is no offender, in either pass."""
        self.armed = False
        count = len(self.names)
        evidence = torch.stack(self._evidence).double() if self._evidence else self.clock[:0]
        weight_pieces = [] if weights is None else weights.pieces()
        (flags, gradients, *weight_host), rows = self._outputs.rows(
            [evidence, torch.cat([self.clock[:0]] + [_count(c) for c in self._grad_outputs + self._grad_inputs])] + weight_pieces)
        used = NonfiniteWeights() if weights is None else weights.seen(weight_host)
        bad = ~np.isfinite(flags)
        grad_outputs, grad_inputs = gradients[:count], gradients[count:]
        failed = S.Rows(rows).failed
        traces: dict[int, ModuleTrace] = {}
        for index, calls in enumerate(self._calls):
            if calls:
                trace = traces[index] = ModuleTrace(self.names[index], calls)
                trace.activation_bytes = self._bytes[index] if self._memory else None
                trace.nonfinite = bool(grad_inputs[index] > 0) if self._nonfinite else None
                row = self._row_of.get(index)
                if row is not None and not failed[row]:
                    trace.activation_row = rows[row]
        offender: Optional[Offender] = None
        user: Optional[Offender] = None
        first_call: dict[int, int] = {}
        for call, index in enumerate(self._call_module):
            first_call.setdefault(index, call)
            if self._nonfinite and bad[2 * call + 1]:
                traces[index].nonfinite = True
                if offender is None and not bad[2 * call]:
                    if self.names[index] not in used.modules:
                        offender = Offender(self.names[index], "forward")
                    elif user is None:
                        user = Offender(self.names[index], "forward")
        if offender is None and self._nonfinite:
            offends = [i for i in traces if grad_inputs[i] > 0 and grad_outputs[i] == 0]
            clean = [i for i in offends if self.names[i] not in used.modules]
            if clean:
                offender = Offender(self.names[max(clean, key=first_call.__getitem__)], "backward")
            elif offends and user is None:
                user = Offender(self.names[max(offends, key=first_call.__getitem__)], "backward")
        return ProbeResult([traces[i] for i in sorted(traces)], offender, user, used.names)

    def say_once(self, result: ProbeResult, step: int, failures: FailurePolicy) -> None:
        """What a sampled step inside compiled code showed, said once: armed hooks that recorded
        nothing (in ``result``) were attached too late; outputs in bfloat16 or float16 may be
        rounded where the unsampled graph keeps them in float32."""
        if self.low_precision:
            failures.warn_once(
                "compiled-low-precision",
                "layerwatch: modules inside compiled code output bfloat16 or float16 tensors. Measuring an output "
                "makes Inductor store it, rounded to its dtype, where the unsampled graph may keep it in float32 "
                "inside a fused kernel: a sampled step's results, and the run after it, may then differ in the last "
                "bits from the run without layerwatch (float32 models are bitwise unchanged). For a bitwise "
                f"low-precision compiled run, leave the per-module families {list(PROBE_FAMILIES)} out of families=.",
            )
        inside = set(self.names)
        if inside and not any(trace.name in inside for trace in result.modules):
            failures.warn_once(
                "compiled-late",
                f"layerwatch: the hooks inside compiled code recorded nothing on sampled step {step}: the model's forward (or "
                "that of another instance of its class) was compiled before layerwatch attached them, and compiled code "
                "never runs hooks added later (Dynamo does not recompile for them). Attach layerwatch "
                "(Inspector(...).start(), or the callback) before the model's first forward, or call "
                "torch._dynamo.reset() before the next one so that it compiles again with them.",
            )


_PROBES = Numbering()
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _measure_call(outputs: list[torch.Tensor], inputs: list[torch.Tensor], clock: torch.Tensor, probe: int,
                  index: int) -> None:
    """One call of module ``index``, measured by traced probe ``probe`` (:meth:`TracedProbe.measure`)."""
    traced = _PROBES.get(probe)
    if traced is not None:
        started = perf_counter_ns()
        traced.measure(outputs, inputs, index)
        traced.host_ns += perf_counter_ns() - started


def _as_one_op(function: Any) -> Any:
    """``function`` as one opaque operator of the graph (``torch.library.custom_op``, torch 2.4
    and later): Dynamo traces a call of it as one node, and compiled code calls its Python body
    eagerly with the real tensors. The probe's work is then the eager probes' (a copy of the
    output, reduced with all the others after the step) for one node; the same work traced
    op by op made the armed graph's compile minutes long (``docs/performance.md``). It says it
    mutates ``clock``, so that the graph keeps it."""
    if not hasattr(torch.library, "custom_op"):
        return None
    return torch.library.custom_op("layerwatch::measure_call", function, mutates_args=("clock",))


measure_call = _as_one_op(_measure_call)


def _counter(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float64, device=device, requires_grad=True)


def _count(counter: torch.Tensor) -> torch.Tensor:
    """What :class:`GradientCount` gave ``counter`` since the probe was armed (zero where no backward reached it)."""
    return counter.detach() * 0 if counter.grad is None else counter.grad


def _counted(obj: Any, counter: torch.Tensor) -> tuple[Any, bool]:
    """``obj`` with its first tensor that needs a gradient passed through :class:`GradientCount`
    into ``counter``, and whether it had one."""
    return with_first_replaced(obj, lambda t: t.requires_grad and is_float(t), lambda t: GradientCount.apply(t, counter))


class GradientCount(torch.autograd.Function):
    """A copy of ``tensor`` whose backward passes its gradient on unchanged and gives
    ``counter`` (a leaf of one float64) the number of NaN/Inf values in it as its gradient:
    autograd adds them up over calls, compiled code as eager, with no hook and no state.

    A copy, not a view: a module's output may be changed in place by the code after it, which
    autograd refuses for a view a custom Function returned. Its values are the tensor's. Only a
    backward that accumulates into leaves counts (``loss.backward()``, not ``torch.autograd.grad``
    of some parameters)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(counter)
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (counter,) = ctx.saved_tensors
        return grad, (~torch.isfinite(grad)).sum().reshape(1).to(counter)
