"""Attention inside compiled code: each ``scaled_dot_product_attention`` call of an armed
compiled forward, measured as the eager attention probe measures it
(:mod:`~layerwatch.probes.attention`), by an opaque operator of the armed graph.

A compiled graph keeps what Dynamo traced, so the eager probe's wrapper, put in place for one
forward, is never seen there (and would make Dynamo compile again). Here a wrapper stands in
for ``torch.nn.functional.scaled_dot_product_attention`` from before the first compiled
forward until the run ends (:class:`CompiledAttention`, made with the traced probe's hooks).
Dynamo traces it: unarmed, it calls torch's function alone, and the graph is the one it would
be without it; armed (the traced probe's ``armed``, a bool Dynamo guards on, so the armed
variant is the traced probe's own and no graph is added), it adds one node after the call,
:data:`measure_attention`, whose body compiled code runs eagerly with the real query, key and
mask: ``ROWS`` query rows' logits against every key, as in eager, enqueued on the device.
A call on tensors of another type is not measured: a DTensor, or the fake and functional
tensors of a tracer running it (Dynamo keeps ``F.multi_head_attention_forward`` as one node and
runs it on fake tensors; AOTAutograd then traces into it): compiled code that runs that node as
a Python call measures it then, one that decomposed it does not.

Inside a graph no Python stack names the module that made the call. The operator notes how
many module calls the traced probe had seen end before it. After the step, the call's holder
is the first module to end after it that holds the last module to end before it (its query,
key and value projections, computed just before); the call belongs to the first module, up to
its holder, whose class is an attention (its name says so: torch's ``MultiheadAttention``,
Hugging Face's ``…Attention``, timm's ``Attention``), else to its holder. Eagerly run calls (a
graph break) are measured the same.
"""

from __future__ import annotations

import weakref
from time import perf_counter_ns
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from layerwatch.probes.attention import SDPA_ARGUMENTS, attention_rows
from layerwatch.vocabulary import ROOT


class CompiledAttention:
    """The wrapper standing in for torch's SDPA while a traced probe's hooks are on, and the
    calls it measured on the armed steps. :meth:`remove` puts torch's function back (unless
    another wrapper stands in for it by then: this one then calls torch's alone)."""

    def __init__(self, traced: Any, attention_like: set[int]) -> None:
        self._traced = traced
        self._attention_like = attention_like  # the traced probe's modules whose class is an attention
        self._calls: list[tuple[int, torch.Tensor]] = []  # (module calls ended before it, its [heads, 3])
        self.error: Optional[BaseException] = None
        self._original = original = F.scaled_dot_product_attention
        probe_id = id(self)
        _PROBES[probe_id] = self
        gate = self._gate = _Gate(traced)

        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if gate.on and gate.traced.armed and measure_attention is not None:
                given = dict(zip(SDPA_ARGUMENTS, args)) | kwargs
                query, key, mask = given["query"], given["key"], given.get("attn_mask")
                # plain tensors: not a DTensor, nor the fake or functional ones of a tracer running it
                if type(query) is torch.Tensor and type(key) is torch.Tensor and (mask is None or type(mask) is torch.Tensor):
                    measure_attention(query.detach(), key.detach(), None if mask is None else mask.detach(),
                                      bool(given.get("is_causal", False)), given.get("scale"),
                                      bool(given.get("enable_gqa", False)), gate.traced.clock, probe_id)
            return out

        self._wrapper = scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention

    def remove(self) -> None:
        self._gate.on = False
        if F.scaled_dot_product_attention is self._wrapper:
            F.scaled_dot_product_attention = self._original

    def clear(self) -> None:
        self._calls = []

    def measure(self, query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
                scale: Optional[float], enable_gqa: bool) -> None:
        """One call, eagerly (the operator's body): device work enqueued, nothing read."""
        if self.error is not None:
            return
        try:
            self._calls.append((self._traced.calls_ended, attention_rows(query, key, mask, is_causal, scale, enable_gqa)))
        except Exception as e:  # kept, said by the caller; the training goes on
            self.error = e

    def by_module(self, ended: Sequence[int], names: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        """The step's calls by the module each belongs to, given the traced probe's module calls
        in the order they ended (``ended``: their modules' indices into ``names``)."""
        out: dict[str, list[torch.Tensor]] = {}
        for before, rows in self._calls:
            owner = self._owner(before, ended, names)
            if owner is not None:
                out.setdefault(owner, []).append(rows)
        self._calls = []
        return out

    def _owner(self, before: int, ended: Sequence[int], names: Sequence[str]) -> Optional[str]:
        after = ended[before:]
        if not after:
            return None
        last = names[ended[before - 1]] if before > 0 else None
        holder = next((i for i, index in enumerate(after) if last is not None and (
            names[index] in (ROOT, last) or last.startswith(names[index] + "."))), len(after) - 1)
        attention = next((index for index in after[:holder + 1] if index in self._attention_like), None)
        return names[attention if attention is not None else after[holder]]


class _Gate:
    """What the wrapper reads: whether its probe still stands, and the traced probe it measures for."""

    def __init__(self, traced: Any) -> None:
        self.on, self.traced = True, traced


_PROBES: "weakref.WeakValueDictionary[int, CompiledAttention]" = weakref.WeakValueDictionary()


def _measure_attention(query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
                       scale: Optional[float], enable_gqa: bool, clock: torch.Tensor, probe: int) -> None:
    """One SDPA call inside compiled code, measured by :class:`CompiledAttention` ``probe``."""
    attention = _PROBES.get(probe)
    if attention is not None:
        started = perf_counter_ns()
        attention.measure(query, key, mask, is_causal, scale, enable_gqa)
        attention._traced.host_ns += perf_counter_ns() - started


measure_attention = (torch.library.custom_op("layerwatch::measure_attention", _measure_attention, mutates_args=("clock",))
                     if hasattr(torch.library, "custom_op") else None)
