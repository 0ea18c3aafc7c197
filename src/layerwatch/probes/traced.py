"""The traced probe: per-module measurements made inside compiled code.

Module hooks that Dynamo traces become part of the compiled graph. A :class:`TracedProbe`'s
hook starts with a plain Python bool, ``armed``: Dynamo guards on it, so compiled code has
two variants, the one it would have without layerwatch (unarmed, every step between samples)
and the armed one (sampled steps), and switches between them with no recompile. Armed, the
hook writes its module's output row (:func:`~layerwatch.stats.traced_row`), NaN/Inf counts
and call order into buffers allocated once, in place; nothing is read on the host until the
step is over (:meth:`TracedProbe.pieces`, one transfer with the rest of the step).

Compiled code keeps the hooks it was traced with: hooks added after the first compiled call
never run (Dynamo does not guard on them, ``skip_nnmodule_hook_guards``), and removing them
would not stop them either. So these hooks are attached once, before the first compiled
forward, and stay until the engine finishes; a step whose armed hooks wrote nothing is how
a late attachment shows (:attr:`TracedProbe.wrote`).

Two ways in, one probe: as the hooks of the modules inside a ``torch.compile``'d module
(:meth:`attach`), or called by the eager runtime probe's hooks when Dynamo traces them (a
model called from a compiled function). Called eagerly (``set_stance("force_eager")``, a
graph break) the same ops run eagerly, and write the same rows.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.hooks import inlined_only, tensors_in
from layerwatch.probes.outputs import is_float
from layerwatch.probes.runtime import ModuleTrace, Offender, ProbeResult
from layerwatch.probes.selection import probe_name

# Columns of a module's facts row (float64: one transfer with the stats rows).
CALLS = 0
ORDER = 1  # the forward clock at its first call
FIRST_FORWARD = 2  # the earliest call (forward clock) that turned finite inputs into a non-finite output
OUTPUT_NONFINITE = 3  # NaN/Inf values in its outputs, over its calls
BYTES = 4  # the bytes its outputs hold, over its calls
FACTS = 5
NEVER = float(2**52)  # a forward clock value no step reaches


class TracedProbe:
    """Gated hooks on modules that run inside compiled code; see the module's docstring."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], *, families: Sequence[str], bins: int, zeros: bool,
                 centered: bool, device: torch.device) -> None:
        self.armed = False
        self.names = [probe_name(name) for name, _ in modules]
        self._index = {id(module): index for index, (_, module) in enumerate(modules)}
        self._activations = "activations" in families
        self._nonfinite = "nonfinite" in families
        self._memory = "memory" in families
        self._bins, self._zeros, self._centered = bins, zeros, centered
        count = len(modules)
        self.facts = torch.zeros(count, FACTS, dtype=torch.float64, device=device)
        # NaN/Inf values in the gradients of each module's outputs and of its inputs, over its calls:
        # a tensor each, written by one gradient hook only. A buffer two hooks share fails
        # autograd's version check when one hook runs outside compiled backward code (on a
        # graph output) and the other inside it (which saved the buffer).
        self._grad_outputs = [torch.zeros(1, dtype=torch.float64, device=device) for _ in modules]
        self._grad_inputs = [torch.zeros(1, dtype=torch.float64, device=device) for _ in modules]
        width = S.row_width(bins) if self._activations else 0
        self.rows = torch.zeros(count, width, dtype=torch.float64, device=device)
        # Counters are 1-d: Dynamo (2.13) did not write back an in-place add to a 0-d tensor attribute
        self.clock = torch.zeros(1, dtype=torch.float64, device=device)
        self._handles: list[Any] = []
        self._clear()

    def attach(self, modules: Sequence[nn.Module]) -> None:
        """Hook ``modules`` (of those this probe was made for) until :meth:`remove`."""
        self._handles += [module.register_forward_hook(self.record) for module in modules]

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def arm(self) -> None:
        """Clear the buffers (device ops outside the graph) and turn recording on."""
        self._clear()
        self.armed = True

    def _clear(self) -> None:
        with torch.no_grad():
            self.facts.zero_()
            self.facts[:, FIRST_FORWARD] = NEVER
            self.clock.zero_()
            torch._foreach_zero_(self._grad_outputs + self._grad_inputs)

    def disarm(self) -> None:
        self.armed = False

    def pieces(self) -> list[torch.Tensor]:
        """What :meth:`result` reads, for the step's one transfer."""
        return [self.facts, torch.stack(self._grad_outputs + self._grad_inputs), self.rows]

    # ------------------------------------------------------------------ in the graph
    # No host read, no Python state changed: Dynamo would replay a mutation of a list on every
    # call, and recompile for it.

    @inlined_only
    def record(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.armed:
            return
        index = self._index.get(id(module))
        if index is None:
            return
        outputs = [t for t in tensors_in(output) if is_float(t)]
        inputs = [t for t in tensors_in(args) if is_float(t)]
        with torch.no_grad():
            facts = self.facts[index]
            first_call = facts[CALLS] == 0
            facts[ORDER].copy_(torch.where(first_call, self.clock[0], facts[ORDER]))
            bad_in = sum_nonfinite(inputs, facts)
            if self._activations and outputs:
                flat = [t.detach().reshape(-1).float() for t in outputs]
                row = S.traced_row(flat[0] if len(flat) == 1 else torch.cat(flat), self._bins, self._zeros, self._centered)
                self.rows[index].copy_(torch.where(first_call, row, self.rows[index]))
                bad_out = row[S.NONFINITE]
            else:
                bad_out = sum_nonfinite(outputs, facts)
            clock = self.clock[0]
            if self._nonfinite:
                offends = (bad_out > 0) & (bad_in == 0)
                facts[FIRST_FORWARD].copy_(torch.minimum(facts[FIRST_FORWARD], torch.where(offends, clock, NEVER)))
                facts[OUTPUT_NONFINITE].add_(bad_out)
            if self._memory:
                facts[BYTES].add_(sum(t.numel() * t.element_size() for t in outputs))
            facts[CALLS].add_(1)
            clock.add_(1)
        if self._nonfinite and torch.is_grad_enabled():
            needing = [t for t in outputs if t.requires_grad]
            if needing:  # its backward starts
                needing[0].register_hook(functools.partial(count_nonfinite_into, self._grad_outputs[index]))
            needing = [t for t in inputs if t.requires_grad]
            if needing:  # its backward is done
                needing[0].register_hook(functools.partial(count_nonfinite_into, self._grad_inputs[index]))

    # ------------------------------------------------------------------ after the step

    @staticmethod
    def wrote(facts: np.ndarray) -> bool:
        """Whether any hook recorded a call (host facts)."""
        return bool(facts[:, CALLS].any())

    def result(self, facts: np.ndarray, gradients: np.ndarray, rows: np.ndarray) -> ProbeResult:
        """The step's measurements from the host copies of :meth:`pieces`.

        The backward's first offender is the module whose outputs' gradient was finite and whose
        inputs' gradient was not, latest in the forward's order: the backward runs the graph
        in reverse, and this is its order wherever a module's gradient depends on the modules
        after it."""
        count = len(self.names)
        facts, rows = facts.reshape(count, FACTS), rows.reshape(count, self.rows.shape[1])
        grad_outputs, grad_inputs = gradients[:count], gradients[count : 2 * count]
        failed = S.failed_rows(rows) if self._activations else np.zeros(count, bool)
        traces = []
        for index, name in enumerate(self.names):
            calls = int(facts[index, CALLS])
            if not calls:
                continue
            trace = ModuleTrace(name, calls)
            if self._memory:
                trace.activation_bytes = int(facts[index, BYTES])
            if self._nonfinite:
                trace.nonfinite = bool(facts[index, OUTPUT_NONFINITE] > 0 or grad_inputs[index] > 0)
            if self._activations and not failed[index]:
                trace.activation_row = rows[index]
            traces.append(trace)
        offender = None
        if self._nonfinite and facts[:, FIRST_FORWARD].min() < NEVER:
            offender = Offender(self.names[int(np.argmin(facts[:, FIRST_FORWARD]))], "forward")
        elif self._nonfinite:
            offends = (grad_inputs > 0) & (grad_outputs == 0) & (facts[:, CALLS] > 0)
            if offends.any():
                offender = Offender(self.names[int(np.argmax(np.where(offends, facts[:, ORDER], -1.0)))], "backward")
        return ProbeResult(traces, offender)


@inlined_only
def count_nonfinite_into(total: torch.Tensor, grad: torch.Tensor) -> None:
    """A gradient hook: adds the NaN/Inf values of ``grad`` to ``total``."""
    with torch.no_grad():
        total.add_((~torch.isfinite(grad.detach())).sum())


def sum_nonfinite(tensors: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """How many NaN/Inf values ``tensors`` hold, as a float64 0-d tensor on ``like``'s device."""
    total = torch.zeros((), dtype=torch.float64, device=like.device)
    for t in tensors:
        total = total + (~torch.isfinite(t.detach())).sum()
    return total
