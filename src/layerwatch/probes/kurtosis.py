"""The kurtosis of a module output's per-channel RMS, on a sampled step's eager forward: with
``s_j`` the RMS of channel ``j`` (the last dimension) over every other dimension,
``mean(s⁴) / mean(s²)²``. 1 when every channel has the same size; up to the channel count when
one channel holds all of it: the outlier features of He et al. (2024), which Composer's
ActivationMonitor logs per batch and Megatron dropped at "up to 30% of the step time". Here a
forward hook on each probed module, on sampled steps only, keeps the output; once the forward
is over (outside every module's time) three ops on the device make it, and the step's values
reach the host together at its end. On a compiled model's re-run (autograd off: nothing else keeps
the output) each is measured as it comes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch.guards.hooks import InertHooks, is_compiling


def channel_kurtosis(h: torch.Tensor) -> torch.Tensor:
    """``mean(s⁴) / mean(s²)²`` of ``h``'s per-channel RMS ``s`` (its last dimension the channels)."""
    with torch.no_grad():
        s2 = h.detach().float().pow(2).reshape(-1, h.shape[-1]).mean(0)
        return (s2 * s2).mean() / s2.mean() ** 2


class ChannelKurtosis(InertHooks):
    """One sampled step's kurtosis per module: each module's first output of two or more
    dimensions and at least 2 channels, kept (:meth:`keep`; by forward hooks, :meth:`hook`)
    until :meth:`flush`. ``remove()`` is safe twice."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, torch.Tensor] = {}
        self.error: Optional[BaseException] = None
        self._pending: dict[str, torch.Tensor] = {}
        self._after: Optional[Callable[[Any], None]] = None

    def hook(self, modules: Sequence[tuple[str, nn.Module]], after: Optional[Callable[[Any], None]] = None) -> None:
        """Forward hooks keeping the output of each of ``modules``, under its name; ``after(self)``
        then, when given (the re-run measures it at once)."""
        self._after = after
        self._handles += [module.register_forward_hook(self._hook(name)) for name, module in modules]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if is_compiling() or self.inert:  # traced by Dynamo, or kept inert (StepProbes): nothing
                return
            self.keep(name, output)
            if self._after is not None:
                self._after(self)
        return hook

    def keep(self, name: str, output: Any) -> None:
        """Module ``name``'s output (a tuple's first: a block's hidden states), kept when it is
        its first that has channels."""
        if isinstance(output, (tuple, list)) and output:
            output = output[0]
        if name in self.values or name in self._pending or not isinstance(output, torch.Tensor):
            return
        if output.dim() >= 2 and output.shape[-1] >= 2 and output.is_floating_point() and output.numel():
            self._pending[name] = output

    def flush(self) -> None:
        """Measure the outputs kept; a failure is kept, not raised."""
        pending, self._pending = self._pending, {}
        if self.error is not None:
            return
        try:
            self.values.update([(name, channel_kurtosis(output)) for name, output in pending.items()])
        except Exception as e:
            self.error = e

    def on_device(self) -> Optional[torch.Tensor]:
        """Each module's kurtosis, in :attr:`values`' order; None when none was made or one failed."""
        self.flush()
        if self.error is not None or not self.values:
            return None
        return torch.stack(list(self.values.values()))

    def from_host(self, values: np.ndarray) -> dict[str, float]:
        """Module -> :meth:`on_device`'s value brought to the host (finite ones)."""
        return {name: float(v) for name, v in zip(self.values, values) if np.isfinite(v)}
