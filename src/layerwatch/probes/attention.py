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
``is_causal``, grouped-query heads), in float32:

- **the largest logit** of each head: the maximum over those rows, their keys and the batch;
- **the entropy** of each head: ``−Σ p log p`` of those rows' softmax, averaged over the rows and
  the batch (in nats; ``log(keys)`` is uniform attention, 0 is one-hot).

A call belongs to the innermost module of the model whose ``forward`` is on the Python stack
(``transformer.h.0.attn``). Its cost is ``ROWS / queries`` of the attention scores' work, and
nothing is read on the host until the step's end.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F


ROWS = 64  # query rows sampled per call


def attention_stats(q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                    scale: Optional[float] = None, enable_gqa: bool = False, rows: int = ROWS) -> torch.Tensor:
    """``[heads, 2]``: each head's largest logit and mean entropy over ``rows`` query rows
    evenly spread over the sequence, as ``scaled_dot_product_attention(q, k, ...)`` computes
    them (``q``: ``(..., heads, queries, d)``, ``k``: ``(..., kv_heads, keys, d)``)."""
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
        mean_entropy = torch.where(seen, entropy, 0).sum(-1) / seen.sum(-1)
        return torch.stack([largest, mean_entropy], dim=1)


class AttentionProbe:
    """The attention calls of one sampled step: torch's function stands in for a wrapper from
    :meth:`start` to :meth:`stop` (:class:`~layerwatch.probes.transformer.TransformerProbes`
    calls them as the model's forward begins and ends); each call's inputs are kept, and
    measured by :meth:`flush` once the forward is over, outside every module's time."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names  # id(module) -> its name, for the modules whose calls are kept
        self.calls: dict[str, list[torch.Tensor]] = {}  # module -> each call's [heads, 2]
        self.error: Optional[BaseException] = None
        self.pending: list[tuple[str, dict]] = []  # (module, the call's arguments) not measured yet
        self._original: Any = None  # torch's function, while the wrapper stands in for it

    def start(self) -> None:
        if self._original is not None:
            return
        original = self._original = F.scaled_dot_product_attention

        @functools.wraps(original)
        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.seen(args, kwargs)
            return out

        F.scaled_dot_product_attention = scaled_dot_product_attention

    def stop(self) -> None:
        if self._original is not None:
            F.scaled_dot_product_attention, self._original = self._original, None

    def seen(self, args: tuple, kwargs: dict) -> None:
        """One call, by the innermost module of the model on the stack: kept for :meth:`flush`."""
        if self.error is not None:
            return
        name = self._caller()
        if name is not None:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            self.pending.append((name, dict(zip(names, args)) | kwargs))

    def flush(self) -> None:
        """Measure the calls kept; a failure is kept, not raised (the user's training goes on)."""
        pending, self.pending = self.pending, []
        if self.error is not None:
            return
        try:
            for name, given in pending:
                row = attention_stats(given["query"], given["key"], given.get("attn_mask"), bool(given.get("is_causal", False)),
                                      given.get("scale"), bool(given.get("enable_gqa", False)))
                self.calls.setdefault(name, []).append(row)
        except Exception as e:
            self.error = e

    def _caller(self) -> Optional[str]:
        frame = sys._getframe(2)
        while frame is not None:
            owner = frame.f_locals.get("self") if frame.f_code.co_name in ("forward", "_call_impl") else None
            name = self.names.get(id(owner)) if owner is not None else None
            if name is not None:
                return name
            frame = frame.f_back
        return None

    def remove(self) -> None:
        self.stop()

    def on_device(self) -> Optional[torch.Tensor]:
        """Per module, ``[heads, 2]`` (each head's largest logit over every call, its mean entropy
        over the calls), stacked in :attr:`calls`' order; None when none was seen or one failed."""
        self.flush()
        if self.error is not None or not self.calls:
            return None
        return torch.cat([torch.stack([torch.stack(rows)[:, :, 0].amax(0), torch.stack(rows)[:, :, 1].mean(0)], dim=1)
                          for rows in self.calls.values()])

    def from_host(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`on_device`'s values, brought to the host, per module."""
        sizes = [len(rows[0]) for rows in self.calls.values()]  # heads: shapes, known without a read
        return dict(zip(self.calls, np.split(values.reshape(-1, 2), np.cumsum(sizes)[:-1])))
