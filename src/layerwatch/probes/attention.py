"""Attention, per layer and per head, on a sampled step's forward: the largest attention logit
and the attention entropy, exact on a fixed sample of query rows.

Every call of ``torch.nn.functional.scaled_dot_product_attention`` during the forward (Hugging
Face's SDPA models, timm, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` when they
need no weights: each looks the function up in ``torch.nn.functional`` when it calls it) is seen
by a wrapper put there only while the sampled step's forward runs, and put back when it ends or
raises. Every other op runs untouched (a :class:`~torch.overrides.TorchFunctionMode` would put a
Python call before each, and the step's ``fwd_ms`` would measure it). The call itself runs as
it would without it (its output is the same tensor, bitwise); its inputs are kept (the kernel
keeps them for the backward anyway) and, once the forward is over and every module's time
taken, for each call the logits ``q·k/√d`` of ``ROWS`` query rows evenly spread over
the sequence are computed against every key, under the call's own mask (``attn_mask``,
``is_causal``, grouped-query heads), in float32 (on a compiled model's re-run, where autograd is
off and nothing else keeps them, as each call ends, outside the modules' time):

- **the largest logit** of each head: the maximum over those rows, their keys and the batch;
- **the entropy** of each head: ``−Σ p log p`` of those rows' softmax, averaged over the rows and
  the batch (in nats; ``log(keys)`` is uniform attention, 0 is one-hot).

FlexAttention's calls are measured from its kernel's own statistics instead, through a stand-in
put in place for the same forward (:mod:`~layerwatch.probes.flex_attention`).

A call belongs to the innermost module of the model whose ``forward`` is on the Python stack
(``transformer.h.0.attn``). Its cost is ``ROWS / queries`` of the attention scores' work, and
nothing is read on the host until the step's end.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from layerwatch.distributed.sharding import local, spread
from layerwatch.guards.hooks import is_compiling
from layerwatch.probes.flex_attention import EAGER, FLEX, flex_rows


ROWS = 64  # query rows sampled per call


def attention_stats(q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                    scale: Optional[float] = None, enable_gqa: bool = False, rows: int = ROWS) -> torch.Tensor:
    """``[heads, 2]``: each head's largest logit and mean entropy over ``rows`` query rows
    evenly spread over the sequence, as ``scaled_dot_product_attention(q, k, ...)`` computes
    them (``q``: ``(..., heads, queries, d)``, ``k``: ``(..., kv_heads, keys, d)``)."""
    return attention_rows(q, k, attn_mask, is_causal, scale, enable_gqa, rows)[:, :2]


def attention_rows(q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool,
                   scale: Optional[float], enable_gqa: bool, rows: int = ROWS) -> torch.Tensor:
    """:func:`attention_stats` and a third column: the rows its mean entropy is over (those
    with a key left), by which calls and ranks are weighed."""
    with torch.no_grad():
        queries, keys, d = q.shape[-2], k.shape[-2], q.shape[-1]
        count = min(rows, queries)  # evenly spread, at least 1 apart: distinct once rounded (no unique(): a sync)
        index = (torch.arange(count, device=q.device, dtype=torch.float64) * ((queries - 1) / max(count - 1, 1))).round().long()
        q_rows = q.index_select(-2, index).float()
        k = k.float()
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        logits = (q_rows @ k.transpose(-2, -1)) * (scale if scale is not None else d ** -0.5)
        keep = None
        if is_causal:  # top-left aligned, as the kernel's: query i sees keys 0..i
            keep = torch.arange(keys, device=q.device) <= index[:, None]
        if attn_mask is not None:
            mask = attn_mask if attn_mask.shape[-2] == 1 else attn_mask.index_select(-2, index)
            if mask.dtype == torch.bool:
                keep = mask if keep is None else keep & mask
            else:
                logits = logits + mask.float()
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        heads = logits.shape[-3]
        by_head = logits.transpose(-3, 0).reshape(heads, -1, keys) if logits.dim() > 3 else logits
        largest = by_head.amax(dim=(1, 2))
        p = torch.softmax(by_head, dim=-1)
        entropy = torch.special.entr(p).sum(-1)  # a row with no key left: NaN, left out below
        seen = entropy.isfinite()
        count = seen.sum(-1)
        return torch.stack([largest, torch.where(seen, entropy, 0).sum(-1) / count, count.to(largest.dtype)], dim=1)


class AttentionProbe:
    """The attention calls of one sampled step: torch's function stands in for a wrapper from
    :meth:`start` to :meth:`stop` (:class:`~layerwatch.probes.transformer.TransformerProbes`
    calls them as the model's forward begins and ends); each call's inputs are kept, and
    measured by :meth:`flush` once the forward is over, outside every module's time."""

    def __init__(self, names: dict[int, str], aside: Optional[Callable[[Callable[[], None]], None]] = None,
                 dense_limit: Optional[int] = None) -> None:
        self.names = names  # id(module) -> its name, for the modules whose calls are kept
        # With ``aside`` (a compiled model's re-run, autograd off: nothing keeps a call's inputs),
        # each call is measured as it ends, its time left out of the modules' by ``aside``.
        self._aside = aside
        self.dense_limit = dense_limit  # the most score bytes a FlexAttention call run eagerly may build
        self.calls: dict[str, list[torch.Tensor]] = {}  # module -> each call's [heads, 3] (attention_rows)
        self.split: dict[str, Optional[tuple[int, ...]]] = {}  # module -> the global ranks its heads are split over
        self.error: Optional[BaseException] = None
        self.unmeasured = False  # a FlexAttention call whose kernel returns no statistics ran
        self._pending: list[tuple[str, dict]] = []  # (module, the call's arguments) not measured yet
        self._originals: Optional[tuple[Any, Any]] = None  # torch's functions, while the wrappers stand in for them

    def start(self) -> None:
        if self._originals is not None:
            return
        sdpa, mha = self._originals = F.scaled_dot_product_attention, F.multi_head_attention_forward

        # Traced by Dynamo (a compiled function the eager model calls), a wrapper only calls through.
        @functools.wraps(sdpa)
        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
            out = sdpa(*args, **kwargs)
            if is_compiling():
                return out
            self.seen(dict(zip(SDPA_ARGUMENTS, args)) | kwargs)
            return out

        @functools.wraps(mha)
        def multi_head_attention_forward(*args: Any, **kwargs: Any) -> Any:
            out = mha(*args, **kwargs)
            if is_compiling():
                return out
            arguments = _mha_signature(mha).bind(*args, **kwargs).arguments
            if arguments.get("need_weights", True):  # computed without SDPA: measured again with it, in flush()
                self.seen({MHA: (mha, arguments)})
            return out

        F.scaled_dot_product_attention, F.multi_head_attention_forward = scaled_dot_product_attention, multi_head_attention_forward
        EAGER.install(self)

    def stop(self) -> None:
        if self._originals is not None:
            (F.scaled_dot_product_attention, F.multi_head_attention_forward), self._originals = self._originals, None
            EAGER.remove()

    def measure_flex(self, lse: Optional[torch.Tensor], top: Optional[torch.Tensor]) -> None:
        """One FlexAttention call (:mod:`~layerwatch.probes.flex_attention`): its kernel's rows kept."""
        if lse is None:
            self.unmeasured = True
            return
        try:  # called from inside torch's compiled call: a failure is kept, never raised there
            self.seen({FLEX: (lse, top)})
        except Exception as e:
            self.error = e

    def seen(self, given: dict) -> None:
        """One call, by the innermost module of the model on the stack: kept for :meth:`flush`."""
        if self.error is not None:
            return
        caller = self._caller()
        if caller is not None:
            name, module = caller
            if name not in self.split:
                self.split[name] = heads_split(module, given.get("query"))
            self._pending.append((name, given))
            if self._aside is not None:
                self._aside(self.flush)

    def flush(self) -> None:
        """Measure the calls kept; a failure is kept, not raised (the user's training goes on)."""
        pending, self._pending = self._pending, []
        if self.error is not None:
            return
        try:
            for name, given in [(name, call) for name, given in pending for call in as_sdpa_calls(given)]:
                if FLEX in given:
                    self.calls.setdefault(name, []).append(flex_rows(*given[FLEX]))
                    continue
                q, k, mask = (local(given.get(key)) for key in ("query", "key", "attn_mask"))
                row = attention_rows(q, k, mask, bool(given.get("is_causal", False)), given.get("scale"),
                                      bool(given.get("enable_gqa", False)))
                self.calls.setdefault(name, []).append(row)
        except Exception as e:
            self.error = e

    def _caller(self) -> Optional[tuple[str, Any]]:
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self") if frame.f_code.co_name in ("forward", "_call_impl") else None
            name = self.names.get(id(owner)) if owner is not None else None
            if name is not None:
                return name, owner
            frame = frame.f_back
        return None

    def remove(self, keep_module_hooks: bool = False) -> None:
        """Put torch's functions back (it has no module hooks to keep)."""
        self.stop()

    def on_device(self) -> Optional[torch.Tensor]:
        """Per module, ``[heads, 3]`` (each head's largest logit over every call, its mean
        entropy over the calls' rows, those rows), stacked in :attr:`calls`' order; None when
        none was seen or one failed."""
        self.flush()
        if self.error is not None or not self.calls:
            return None
        return torch.cat([_merged(torch.stack(rows)) for rows in self.calls.values()])

    def from_host(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`on_device`'s values, brought to the host: module -> ``[heads, 3]``."""
        sizes = [len(rows[0]) for rows in self.calls.values()]  # heads: shapes, known without a read
        return dict(zip(self.calls, np.split(values.reshape(-1, 3), np.cumsum(sizes)[:-1])))


SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
MHA = "multi_head_attention_forward"  # a kept call of it: (torch's function, its arguments)


@functools.cache
def _mha_signature(function: Any) -> inspect.Signature:
    return inspect.signature(function)


def as_sdpa_calls(given: dict) -> list[dict]:
    """A kept call's SDPA calls: itself; or, for ``nn.MultiheadAttention`` asked for its weights
    (computed without SDPA), the SDPA call torch's function makes without them, run again
    (without dropout, no gradient), seen through a stand-in for SDPA: the same projections
    and merged masks as the step's, at one more attention forward per call."""
    if MHA not in given:
        return [given]
    mha, arguments = given[MHA]
    calls: list[dict] = []
    standing = F.scaled_dot_product_attention  # torch's, or a stand-in of layerwatch's: put back after

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        calls.append(dict(zip(SDPA_ARGUMENTS, args)) | kwargs)
        return torch._C._nn.scaled_dot_product_attention(*args, **kwargs)

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        with torch.no_grad():
            mha(**(arguments | {"need_weights": False, "dropout_p": 0.0}))
    finally:
        F.scaled_dot_product_attention = standing
    return calls


def _merged(rows: torch.Tensor) -> torch.Tensor:
    """``[calls, heads, 3]`` -> ``[heads, 3]``: the largest logit, the mean entropy over every row, the rows."""
    count = rows[:, :, 2].sum(0)
    return torch.stack([rows[:, :, 0].amax(0), (rows[:, :, 1] * rows[:, :, 2]).sum(0) / count, count], dim=1)


def heads_split(module: Any, query: Any) -> Optional[tuple[int, ...]]:
    """The global ranks over which the heads of ``module``'s attention call are split (tensor
    parallel: column-wise query and key projections, each rank computing its own heads), in
    the order of their heads; None when each rank computes every head. Seen from the query
    when it is a DTensor, else from the module's parameters during its forward: FSDP2 holds
    them whole then (plain tensors, or DTensors of the tensor-parallel mesh alone), FSDP1 as
    views of its flat parameter."""
    found = spread(query) if query is not None else None
    if found is None:
        found = next((how for how in map(spread, module.parameters()) if how is not None), None)
    if found is None or found.kind != "shard":
        return None
    return tuple(dist.get_process_group_ranks(found.group))


def combine_heads(parts: Sequence[Optional[dict[str, tuple[Optional[tuple[int, ...]], np.ndarray]]]], rank: int
                  ) -> tuple[dict[str, np.ndarray], list[str]]:
    """Rank ``rank``'s modules with their heads gathered from the ranks they are split over
    (``parts``, each rank's module -> (:func:`heads_split`, ``[heads, 3]``), in rank order; None
    for a rank whose own failed): module -> ``[heads, 2]``, and the modules left out (a rank of
    theirs has not got them alike)."""
    out, left_out = {}, []
    for name, (split, heads) in (parts[rank] or {}).items():
        if split is None:
            out[name] = heads[:, :2]
            continue
        pieces = [(parts[r] or {}).get(name) for r in split]
        if any(piece is None or piece[0] != split for piece in pieces):
            left_out.append(name)
            continue
        out[name] = np.concatenate([piece[1] for piece in pieces])[:, :2]
    return out, left_out
