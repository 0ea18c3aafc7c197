"""Attention inside compiled code: each ``scaled_dot_product_attention`` call of an armed
compiled forward, measured as the eager attention probe measures it
(:mod:`~layerwatch.probes.attention`), by an opaque operator of the armed graph; each
FlexAttention call by its own stand-in, from the kernel's statistics
(:mod:`~layerwatch.probes.flex_attention`), named the same way.

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
tensors of a tracer running it. Dynamo keeps ``F.multi_head_attention_forward`` as one node (it
runs it on fake tensors; AOTAutograd then decomposes it), so it has a stand-in of its own, traced
the same way, whose operator (:data:`measure_mha`) runs torch's function once more through SDPA
with the call's real tensors (:func:`~layerwatch.probes.attention.as_sdpa_calls`). Where
compiled code runs that node as a Python call, neither stand-in measures it again.

Inside a graph no Python stack names the module that made the call. The operator notes how
many module calls the traced probe had seen end before it. After the step, the call's holder
is the first module to end after it that holds the last module to end before it (its query,
key and value projections, computed just before); the call belongs to the first module, up to
its holder, whose class is an attention (its name says so: torch's ``MultiheadAttention``,
Hugging Face's ``…Attention``, timm's ``Attention``), else to its holder. Eagerly run calls (a
graph break) are measured the same.
"""

from __future__ import annotations

import sys
from time import perf_counter_ns
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from layerwatch.probes.attention import MHA, SDPA_ARGUMENTS, as_sdpa_calls, attention_rows
from layerwatch.probes.flex_attention import FlexStandIn, flex_rows
from layerwatch.probes.numbering import Numbering
from layerwatch.vocabulary import ROOT


class CompiledAttention:
    """The wrapper standing in for torch's SDPA while a traced probe's hooks are on, and the
    calls it measured on the armed steps. :meth:`remove` puts torch's function back (unless
    another wrapper stands in for it by then: this one then calls torch's alone)."""

    def __init__(self, traced: Any, attention_like: set[int], traced_only: bool = False) -> None:
        self._traced = traced
        self._attention_like = attention_like  # the traced probe's modules whose class is an attention
        self._calls: list[tuple[int, torch.Tensor]] = []  # (module calls ended before it, its [heads, 3])
        self.error: Optional[BaseException] = None
        self.unmeasured = False  # a FlexAttention call whose kernel returns no statistics ran
        self._original = original = F.scaled_dot_product_attention
        self._number = probe_id = _PROBES.add(self)
        gate = self._gate = _Gate(traced, traced_only)

        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if gate.measures() and measure_attention is not None and not _called_by_mha():
                given = dict(zip(SDPA_ARGUMENTS, args)) | kwargs
                query, key, mask = given["query"], given["key"], given.get("attn_mask")
                # plain tensors: not a DTensor, nor the fake or functional ones of a tracer running it
                if type(query) is torch.Tensor and type(key) is torch.Tensor and (mask is None or type(mask) is torch.Tensor):
                    measure_attention(query.detach(), key.detach(), None if mask is None else mask.detach(),
                                      bool(given.get("is_causal", False)), given.get("scale"),
                                      bool(given.get("enable_gqa", False)), gate.traced.clock, probe_id)
            return out

        self._original_mha = original_mha = F.multi_head_attention_forward

        def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                         bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                                         training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                                         use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                                         v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                                         is_causal=False, **more):  # torch's parameters, by name: no binding traced
            tensors = [query, key, value, in_proj_weight, in_proj_bias, bias_k, bias_v, out_proj_weight, out_proj_bias,
                       key_padding_mask, attn_mask, q_proj_weight, k_proj_weight, v_proj_weight, static_k, static_v]
            out = original_mha(*tensors[:3], embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v,
                               add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training=training,
                               key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                               use_separate_proj_weight=use_separate_proj_weight, q_proj_weight=q_proj_weight,
                               k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight, static_k=static_k,
                               static_v=static_v, average_attn_weights=average_attn_weights, is_causal=is_causal, **more)
            if gate.measures() and measure_mha is not None and not more and not _called_by_graph():
                if all(t is None or type(t) is torch.Tensor or type(t) is nn.Parameter for t in tensors):
                    measure_mha([None if t is None else t.detach() for t in tensors], embed_dim_to_check, num_heads,
                                add_zero_attn, use_separate_proj_weight, is_causal, gate.traced.clock, probe_id)
            return out

        self._wrappers = (scaled_dot_product_attention, multi_head_attention_forward)
        F.scaled_dot_product_attention, F.multi_head_attention_forward = self._wrappers
        self._flex = FlexStandIn(gate.measures)
        self._flex.install(self)

    def remove(self) -> None:
        self._gate.on = False
        self._flex.remove()
        self._flex.release()
        _PROBES.release(self._number)
        if F.scaled_dot_product_attention is self._wrappers[0]:
            F.scaled_dot_product_attention = self._original
        if F.multi_head_attention_forward is self._wrappers[1]:
            F.multi_head_attention_forward = self._original_mha

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

    def measure_flex(self, lse: Optional[torch.Tensor], top: Optional[torch.Tensor]) -> None:
        """One FlexAttention call (:mod:`~layerwatch.probes.flex_attention`), as it runs."""
        started = perf_counter_ns()
        if lse is None:
            self.unmeasured = True
        elif self.error is None:
            try:
                self._calls.append((self._traced.calls_ended, flex_rows(lse, top)))
            except Exception as e:
                self.error = e
        self._traced.host_ns += perf_counter_ns() - started

    def measure_mha(self, tensors: list[Optional[torch.Tensor]], embed_dim: int, num_heads: int, add_zero_attn: bool,
                    use_separate_proj_weight: bool, is_causal: bool) -> None:
        """One ``F.multi_head_attention_forward`` call, eagerly (the operator's body): torch's
        function run once more through SDPA, as the eager probe does for a call that needs weights."""
        if self.error is not None:
            return
        try:
            arguments = dict(zip(MHA_TENSORS, tensors)) | {
                "embed_dim_to_check": embed_dim, "num_heads": num_heads, "add_zero_attn": add_zero_attn,
                "dropout_p": 0.0, "training": False, "use_separate_proj_weight": use_separate_proj_weight,
                "is_causal": is_causal}
            for given in as_sdpa_calls({MHA: (self._original_mha, arguments)}):
                self.measure(given["query"], given["key"], given.get("attn_mask"), bool(given.get("is_causal", False)),
                             given.get("scale"), bool(given.get("enable_gqa", False)))
        except Exception as e:
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
    """What the wrappers read: whether their probe still stands, the traced probe they measure
    for, and whether they measure only where Dynamo traces them (``traced_only``: put in place
    before a caller may compile the model, see :meth:`TracedProbe.stand_in_ahead`)."""

    def __init__(self, traced: Any, traced_only: bool) -> None:
        self.on, self.traced, self.traced_only = True, traced, traced_only

    def measures(self) -> bool:
        """Whether a call is measured (a read of plain attributes, which Dynamo guards on)."""
        return self.on and self.traced.armed and (not self.traced_only or torch.compiler.is_compiling())


_PROBES = Numbering()


def _measure_attention(query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
                       scale: Optional[float], enable_gqa: bool, clock: torch.Tensor, probe: int) -> None:
    """One SDPA call inside compiled code, measured by :class:`CompiledAttention` ``probe``."""
    attention = _PROBES.get(probe)
    if attention is not None:
        started = perf_counter_ns()
        attention.measure(query, key, mask, is_causal, scale, enable_gqa)
        attention._traced.host_ns += perf_counter_ns() - started


def _measure_mha(tensors: list[Optional[torch.Tensor]], embed_dim: int, num_heads: int, add_zero_attn: bool,
                 use_separate_proj_weight: bool, is_causal: bool, clock: torch.Tensor, probe: int) -> None:
    """One ``F.multi_head_attention_forward`` call inside compiled code (:meth:`CompiledAttention.measure_mha`)."""
    attention = _PROBES.get(probe)
    if attention is not None:
        started = perf_counter_ns()
        attention.measure_mha(tensors, embed_dim, num_heads, add_zero_attn, use_separate_proj_weight, is_causal)
        attention._traced.host_ns += perf_counter_ns() - started


MHA_TENSORS = ("query", "key", "value", "in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj_weight",
               "out_proj_bias", "key_padding_mask", "attn_mask", "q_proj_weight", "k_proj_weight", "v_proj_weight",
               "static_k", "static_v")
_MHA_CODE = F.multi_head_attention_forward.__code__


def _called_by_mha() -> bool:
    """Whether SDPA is being called by torch's ``multi_head_attention_forward``, run as Python
    (compiled code calling that node, which :func:`_measure_mha` measures already). Never while
    Dynamo traces (it keeps that function as one node, and cannot trace a frame's code)."""
    return not torch.compiler.is_compiling() and sys._getframe(2).f_code is _MHA_CODE


def _called_by_graph() -> bool:
    """Whether the stand-in is being called by an FX graph's code (compiled code that runs the
    ``multi_head_attention_forward`` node as Python: FX writes it as ``torch.nn.functional.…``,
    looked up when it runs, so it finds the stand-in, whose traced operator is in that graph
    already). Never while Dynamo traces."""
    return not torch.compiler.is_compiling() and sys._getframe(2).f_code.co_filename.startswith("<eval_with_key")


measure_mha = (torch.library.custom_op("layerwatch::measure_mha", _measure_mha, mutates_args=("clock",))
               if hasattr(torch.library, "custom_op") else None)
measure_attention = (torch.library.custom_op("layerwatch::measure_attention", _measure_attention, mutates_args=("clock",))
                     if hasattr(torch.library, "custom_op") else None)
