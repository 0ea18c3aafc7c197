"""``summarize(model, *args, **kwargs)``: the layer table of any model, from one forward.

The table and its formats are :mod:`layerwatch.table.summary`; the hooks that record the forward are
:class:`~layerwatch.table.recording.StructureProbe`; the MAC formulas beyond PyTorch's own
are :mod:`layerwatch.table.flops`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerwatch.table.recording import StructureProbe
from layerwatch.table.summary import Summary


def summarize(model: nn.Module, *args: Any, **kwargs: Any) -> Summary:
    """Run ``model(*args, **kwargs)`` once and return its per-module table.

    The forward runs under ``torch.no_grad()`` in the model's current train/eval mode.
    Every hook is removed afterwards, the train/eval flags and every buffer (BatchNorm
    statistics) are restored, and the global RNG state is left as it was. The fused fast
    path of ``nn.TransformerEncoderLayer``/``nn.MultiheadAttention`` is switched off for the
    call, so their sub-modules run and are counted as they are in training.

    Example:
        >>> from torch import nn
        >>> import torch
        >>> s = summarize(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), torch.randn(2, 8))
        >>> s["0"].macs, s.total_params
        (64, 36)

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: The forward failed; the message names the module that was running.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = getattr(model, "_orig_mod", model)  # torch.compile: measure the eager module
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({t.device.index for t in (*model.parameters(), *model.buffers()) if t.is_cuda} - {None})
    probe = StructureProbe(model, training_only=False)
    fastpath = _mha_fastpath(False)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:
        where = f"{probe.failed_in!r}" if probe.failed_in else "the model"
        raise RuntimeError(f"summarize: the forward failed in {where}: {type(e).__name__}: {e}") from e
    finally:
        probe.remove()
        _mha_fastpath(fastpath)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for module, training in modes:
            module.training = training
    if probe.error is not None:
        raise RuntimeError(f"summarize: could not record the forward: {probe.error!r}")
    return probe.summary()


def _mha_fastpath(enabled: bool) -> bool:
    """Set the fused attention fast path; returns the previous setting."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        return enabled
    previous = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(enabled)
    return previous
