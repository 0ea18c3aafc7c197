"""FlexAttention's calls, measured from the kernel's own statistics of each query row: its
largest score and its logsumexp, which the kernel computes anyway and returns when asked
(what ``return_aux=AuxRequest(max_scores=True, lse=True)`` asks for).

``torch.nn.attention.flex_attention.flex_attention`` calls its higher-order operator through
the module's global ``flex_attention_hop``, looked up at each call: eagerly (inside the small
compiled function it makes) and while Dynamo traces it (a compiled model, or
``torch.compile(flex_attention)`` as Hugging Face and torchtitan call it). A stand-in put there
(:class:`FlexStandIn`) calls the operator itself; while armed, it asks it for both statistics
and hands them to an opaque operator, :data:`measure_flex`, whose body gives them to whoever
the stand-in measures for (its ``receiver``), as the call runs. The call's output is the
kernel's, bitwise: it computes the same scores either way. Unarmed, or not installed, the
operator is called exactly as torch calls it.

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
asked, it would run another kernel), and torch 2.13's
CPU and MPS kernels, which run inference only and return neither. With gradients on the CPU,
which torch refuses in ``flex_attention`` itself, only its reference implementation would run,
and it returns both.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Optional

import torch

from layerwatch.probes.numbering import Numbering

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


class FlexStandIn:
    """The stand-in for FlexAttention's operator, from :meth:`install` to :meth:`remove`. It
    measures calls while ``armed()`` (a read of plain attributes: Dynamo guards on it) and
    gives them to ``receiver.measure_flex(lse, top)`` (``None, None``: a call the kernel could
    not measure), the receiver read as each call runs, not where Dynamo traces. One stand-in
    keeps one function for its whole life, so a compiled caller compiles it once."""

    def __init__(self, armed: Callable[[], bool]) -> None:
        self.receiver: Any = None
        self._previous: Any = None
        if _MODULE is None:
            self._function = None
            return
        self._number = number = _STAND_INS.add(self)
        clock = torch.zeros(1)  # what the operator mutates, so that no compiler drops it

        def flex_attention_hop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Any,
                               block_mask: tuple, scale: float, kernel_options: dict, *buffers: Any) -> Any:
            operator = self._previous
            if not armed() or measure_flex is None or type(query) is not torch.Tensor:  # a DTensor, a tracer's
                return operator(query, key, value, score_mod, block_mask, scale, kernel_options, *buffers)
            if not returns_statistics(query, kernel_options):
                measure_flex(None, None, clock, number)
                return operator(query, key, value, score_mod, block_mask, scale, kernel_options, *buffers)
            asked = dict(kernel_options, OUTPUT_MAX=True, OUTPUT_LOGSUMEXP=True)
            out, lse, top = operator(query, key, value, score_mod, block_mask, scale, asked, *buffers)
            measure_flex(lse.detach(), top.detach(), clock, number)
            return out, lse, top  # the caller keeps what it asked for (flex_attention's _finalize_outputs)

        self._function = flex_attention_hop

    def install(self, receiver: Any) -> None:
        """Stand in for the operator (unless already in the chain of stand-ins there), the calls
        going to ``receiver``."""
        self.receiver = receiver
        if self._function is not None and self not in _chain():
            self._previous, _MODULE.flex_attention_hop = _MODULE.flex_attention_hop, self._function

    def remove(self) -> None:
        """Leave the chain of stand-ins, in whatever order they came: what it stood in for takes
        its place, at the top or under the one that called it."""
        self.receiver = None
        if self._function is None:
            return
        if _MODULE.flex_attention_hop is self._function:
            _MODULE.flex_attention_hop = self._previous
            return
        for above in _chain():
            if above._previous is self._function:
                above._previous = self._previous

    def release(self) -> None:
        """Give up its number (:mod:`~layerwatch.probes.numbering`): it stands in no more."""
        if self._function is not None:
            _STAND_INS.release(self._number)


def _chain() -> list["FlexStandIn"]:
    """The stand-ins in place, from the one torch calls down (install and remove only)."""
    found: list[FlexStandIn] = []
    function = _MODULE.flex_attention_hop
    while True:
        stand_in = next((s for s in _STAND_INS if s._function is function and s not in found), None)
        if stand_in is None:
            return found
        found.append(stand_in)
        function = stand_in._previous


def returns_statistics(query: torch.Tensor, kernel_options: dict) -> bool:
    """Whether the kernel that runs this call returns each row's largest score and logsumexp,
    and asking for them leaves the kernel chosen as it was: not FLASH nor the decoding kernel
    (TRITON_DECODE, or under 128 query rows on a GPU, where Inductor picks it and would pick
    another when asked)."""
    if kernel_options.get("BACKEND") in ("FLASH", "TRITON_DECODE"):
        return False
    if query.device.type == "cpu":  # inference only, returning neither; with gradients, the reference implementation
        return query.requires_grad
    return query.device.type != "mps" and query.shape[-2] >= DECODING_BELOW


DECODING_BELOW = 128  # query rows under which Inductor's FlexAttention takes its decoding kernel (flex_decoding.py)


_STAND_INS = Numbering()
EAGER = FlexStandIn(lambda: True)  # the eager attention probe's: in place only while a sampled forward runs


def _measure_flex(lse: Optional[torch.Tensor], top: Optional[torch.Tensor], clock: torch.Tensor, stand_in: int) -> None:
    """One FlexAttention call, given to the receiver of :class:`FlexStandIn` ``stand_in``."""
    found = _STAND_INS.get(stand_in)
    receiver = None if found is None else found.receiver
    if receiver is not None:
        receiver.measure_flex(lse, top)


measure_flex = (torch.library.custom_op("layerwatch::measure_flex", _measure_flex, mutates_args=("clock",))
                if hasattr(torch.library, "custom_op") else None)
