"""FlexAttention's calls, measured from the kernel's own statistics of each query row: its
largest score and its logsumexp, which the kernel computes anyway and returns when asked
(what ``return_aux=AuxRequest(max_scores=True, lse=True)`` asks for).

``torch.nn.attention.flex_attention.flex_attention`` calls its higher-order operator through
the module's global ``flex_attention_hop``, looked up at each call: inside the small compiled
function it makes when it runs eagerly, and directly when that function runs eagerly too (a
compiled model's re-run, under ``set_stance("force_eager")``). While a sampled forward runs
eagerly, a stand-in put there (:data:`EAGER`, by the eager attention probe) calls the operator
itself, asks it for both statistics and hands them to an opaque operator, :data:`measure_flex`,
whose body gives them to the probe (its ``receiver``) as the call runs. The call's output is the
kernel's, bitwise: it computes the same scores either way. Compiled code is never given the
stand-in: the user's compiled FlexAttention is measured on the eager re-run
(:mod:`~layerwatch.engine.rerun`).

Per head (:func:`flex_rows`), over the batch and every query row with a key left:

- **the largest logit**: the maximum of the rows' largest scores, exact. It is the score after
  the call's ``score_mod`` (a bias, a soft cap), the one its softmax sees;
- **the entropy**: the rows' mean *min-entropy*, ``logsumexp − max`` = ``−log max p``, in nats:
  0 when a row is one-hot, ``log(keys)`` when it is uniform, never above the Shannon entropy
  that SDPA's calls get (:mod:`~layerwatch.probes.attention`). The kernel gives no more, and a
  score_mod cannot be run again outside it.

Where the kernel cannot return them, a call is not measured, and the receiver is told
(``measure_flex`` with no tensors): the ``FLASH`` backend (no largest score), the decoding
kernel (``TRITON_DECODE``, and calls under 128 query rows on a GPU, for which Inductor picks it:
asked, it would run another kernel), and torch 2.13's CPU and MPS kernels, which run inference
only and return neither. With gradients on the CPU, which torch refuses in ``flex_attention``
itself, only its reference implementation would run, and it returns both; so does the operator
run eagerly (the re-run), whose reference implementation builds every score of the call at once:
a receiver with a ``dense_limit`` (the re-run's) is told first, and may refuse a call too large
(:class:`DenseTooLarge`).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Optional

import torch


try:
    _MODULE: Any = importlib.import_module("torch.nn.attention.flex_attention")
    _MODULE.flex_attention_hop  # noqa: B018 (the global the stand-in takes the place of)
except (ImportError, AttributeError):  # a torch without FlexAttention: nothing to stand in for
    _MODULE = None

FLEX = "flex_attention"  # a kept call of it: (its rows' logsumexp, their largest scores), base-2 logarithms
_LN2 = math.log(2.0)


def flex_rows(lse: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``[heads, 3]``: each head's largest logit, its rows' mean min-entropy and those rows, from
    the kernel's ``lse`` and ``max_scores`` (``(batch, heads, queries)``, base-2 logarithms, as
    the operator returns them; a row with no key left: ``-inf``)."""
    with torch.no_grad():
        heads = top.shape[-2]
        top = top.float().transpose(-2, 0).reshape(heads, -1) * _LN2
        lse = lse.float().transpose(-2, 0).reshape(heads, -1) * _LN2
        seen = top.isfinite()
        count = seen.sum(-1)
        largest = torch.where(seen, top, float("-inf")).amax(-1)
        entropy = torch.where(seen, lse - top, 0).sum(-1) / count
        return torch.stack([largest, entropy, count.to(largest.dtype)], dim=1)


class DenseTooLarge(Exception):
    """A call the operator would run eagerly on more score bytes than its receiver's
    ``dense_limit``; ``rows``: the batch rows that fit (0: not one)."""

    def __init__(self, needed: int, limit: int, batch: int) -> None:
        per_row = max(needed // max(batch, 1), 1)
        self.rows = limit // per_row
        super().__init__(f"FlexAttention run eagerly would build {_size(needed)} of scores at once (the bound is "
                         f"{_size(limit)}; {self.rows} of its {batch} batch rows fit)")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:,} bytes"


class FlexStandIn:
    """The stand-in for FlexAttention's operator, from :meth:`install` to :meth:`remove`: while
    it stands, each call is measured and given to ``receiver.measure_flex(lse, top)`` (``None,
    None``: a call the kernel could not measure), the receiver read as each call runs, not where
    Dynamo traces. It keeps one function for its whole life, so torch's own compiled call of
    FlexAttention compiles it once, not again at each sample."""

    def __init__(self) -> None:
        self.receiver: Any = None
        self.standing = False
        self._previous: Any = None
        if _MODULE is None:
            self._function = None
            return
        clock = torch.zeros(1)  # what the operator mutates, so that no compiler drops it

        def flex_attention_hop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Any,
                               block_mask: tuple, scale: float, kernel_options: dict, *buffers: Any) -> Any:
            operator = self._previous
            # (standing: a plain bool, which Dynamo guards on; the receiver is read where the call runs)
            if not self.standing or measure_flex is None or type(query) is not torch.Tensor:  # a DTensor, a tracer's
                return operator(query, key, value, score_mod, block_mask, scale, kernel_options, *buffers)
            if not torch.compiler.is_compiling():  # run eagerly: every score at once
                self._check_dense(query, key)
            if not returns_statistics(query, kernel_options):
                measure_flex(None, None, clock)
                return operator(query, key, value, score_mod, block_mask, scale, kernel_options, *buffers)
            asked = dict(kernel_options, OUTPUT_MAX=True, OUTPUT_LOGSUMEXP=True)
            out, lse, top = operator(query, key, value, score_mod, block_mask, scale, asked, *buffers)
            measure_flex(lse.detach(), top.detach(), clock)
            return out, lse, top  # the caller keeps what it asked for (flex_attention's _finalize_outputs)

        self._function = flex_attention_hop

    def _check_dense(self, query: torch.Tensor, key: torch.Tensor) -> None:
        limit = getattr(self.receiver, "dense_limit", None)
        needed = 4 * query.shape[:-1].numel() * key.shape[-2]  # float32 scores, [batch, heads, queries, keys]
        if limit is not None and needed > limit:
            raise DenseTooLarge(needed, limit, query.shape[0] if query.dim() == 4 else 1)

    def install(self, receiver: Any) -> None:
        """Stand in for the operator (unless it stands already), the calls going to ``receiver``."""
        self.receiver, self.standing = receiver, True
        if self._function is not None and _MODULE.flex_attention_hop is not self._function:
            self._previous, _MODULE.flex_attention_hop = _MODULE.flex_attention_hop, self._function

    def remove(self) -> None:
        """Put back what it stood in for (unless another stand-in took its place since: that one
        calls it, and it then only passes the calls on)."""
        self.receiver, self.standing = None, False
        if self._function is not None and _MODULE.flex_attention_hop is self._function:
            _MODULE.flex_attention_hop = self._previous


def returns_statistics(query: torch.Tensor, kernel_options: dict) -> bool:
    """Whether the kernel that runs this call returns each row's largest score and logsumexp,
    and asking for them leaves the kernel chosen as it was: not FLASH nor the decoding kernel
    (TRITON_DECODE, or under 128 query rows on a GPU, where Inductor picks it and would pick
    another when asked)."""
    if not torch.compiler.is_compiling():  # the operator run eagerly: its reference implementation returns both
        return True
    if kernel_options.get("BACKEND") in ("FLASH", "TRITON_DECODE"):
        return False
    if query.device.type == "cpu":  # inference only, returning neither; with gradients, the reference implementation
        return query.requires_grad
    return query.device.type != "mps" and query.shape[-2] >= DECODING_BELOW


DECODING_BELOW = 128  # query rows under which Inductor's FlexAttention takes its decoding kernel (flex_decoding.py)


EAGER = FlexStandIn()  # the eager attention probe's: in place only while a sampled forward runs


def _measure_flex(lse: Optional[torch.Tensor], top: Optional[torch.Tensor], clock: torch.Tensor) -> None:
    """One FlexAttention call, given to the receiver of :data:`EAGER`."""
    receiver = EAGER.receiver
    if receiver is not None:
        receiver.measure_flex(lse, top)


measure_flex = (torch.library.custom_op("layerwatch::measure_flex", _measure_flex, mutates_args=("clock",))
                if hasattr(torch.library, "custom_op") else None)
