"""MAC and FLOP formulas beyond PyTorch's own.

MACs come from ``torch.utils.flop_counter.FlopCounterMode`` (PyTorch's per-operator formulas:
matmul, linear, convolution, attention), read at the entry and exit of every module call, so
a module's count includes its children's. FlopCounterMode counts two FLOPs per
multiply-accumulate: ``macs = flops // 2``. :func:`extra_flop_formulas` adds what its
registry leaves out.
"""

from __future__ import annotations

from typing import Any

import torch

def extra_flop_formulas() -> dict[Any, Any]:
    """Formulas for two CPU kernels that PyTorch's registry leaves out (so they would count 0):
    flash attention, with PyTorch's own formula for it, and oneDNN's LSTM layer."""
    aten = torch.ops.aten
    extra: dict[Any, Any] = {}
    if hasattr(aten, "mkldnn_rnn_layer"):
        extra[aten.mkldnn_rnn_layer] = _rnn_layer_flops
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError:
        return extra
    formula = flop_registry.get(aten._scaled_dot_product_flash_attention)
    cpu_kernel = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if formula is not None and cpu_kernel is not None and cpu_kernel not in flop_registry:

        def cpu_flash_attention(*args: Any, **kwargs: Any) -> int:
            return formula(*args, **kwargs)

        cpu_flash_attention._get_raw = True  # type: ignore[attr-defined]  # the registry's formula takes tensors
        extra[cpu_kernel] = cpu_flash_attention
    return {op: f for op, f in extra.items() if op not in flop_registry}


def _rnn_layer_flops(inputs: torch.Tensor, weight_ih: torch.Tensor, weight_hh: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    """One direction of one recurrent layer: every time step of every sample multiplies its
    input by ``weight_ih`` and the hidden state by ``weight_hh``."""
    steps = inputs.numel() // inputs.shape[-1]
    return 2 * steps * (weight_ih.numel() + weight_hh.numel())


_rnn_layer_flops._get_raw = True  # type: ignore[attr-defined]
