"""The output head's logits on a sampled step: the mean and the largest of ``log Z``, the
logsumexp of each token's logits over the vocabulary (PaLM's z-loss penalizes ``(log Z)²``:
logits that drift far from a normalized softmax come before divergence late in training).

The head is the module the ``output_head`` option names, else the one Hugging Face's
``get_output_embeddings()`` returns (the outermost module that has it). A forward hook on it,
on sampled steps only, keeps its output; once the forward is over (outside every module's
time) it is reduced on the device: ``[mean, max]`` of ``log Z`` over the batch's tokens, in
float32, averaged (mean) and maxed (max) over the step's calls; on a compiled model's re-run
(autograd off: nothing else keeps the output) as it comes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from layerwatch.distributed.sharding import named_modules
from layerwatch.guards.hooks import is_compiling


def find_output_head(model: nn.Module, name: Optional[str]) -> Optional[tuple[str, nn.Module]]:
    """``(name, module)`` of the output head: the module ``name`` names, else Hugging Face's
    ``get_output_embeddings()`` of the outermost module that has one; None when there is none."""
    modules = dict(named_modules(model))  # wrappers' names cleaned, as the probes' are
    if name is not None:
        return (name, modules[name]) if name in modules else None
    for owner_name, owner in modules.items():
        get = getattr(owner, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except Exception:  # a model that declares it and cannot say
                continue
            for head_name, module in modules.items():
                if module is head:
                    return head_name, module
    return None


def logsumexp_stats(logits: torch.Tensor) -> torch.Tensor:
    """``[mean, max]`` of the logsumexp of ``logits`` over its last dimension."""
    with torch.no_grad():
        lse = torch.logsumexp(logits.detach().float(), dim=-1)
        return torch.stack([lse.mean(), lse.max()])


class OutputLogits:
    """The output head ``name``'s logits of one sampled step, kept (:meth:`keep`; by a forward
    hook, :meth:`hook`) until :meth:`flush`; ``remove()`` is safe twice."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[torch.Tensor] = []
        self.error: Optional[BaseException] = None
        self._pending: list[torch.Tensor] = []
        self._handle: Any = None
        self._after: Optional[Callable[[Any], None]] = None
        self.inert = False

    def hook(self, head: nn.Module, after: Optional[Callable[[Any], None]] = None) -> None:
        """A forward hook keeping ``head``'s output; ``after(self)`` then, when given (the re-run
        measures it at once)."""
        self._after = after
        self._handle = head.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if is_compiling() or self.inert:  # traced by Dynamo, or kept inert (StepProbes): nothing
            return
        self.keep(output)
        if self._after is not None:
            self._after(self)

    def keep(self, output: Any) -> None:
        """One call's output (or its ``logits``), kept."""
        logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.dim() >= 1 and logits.numel():
            self._pending.append(logits)

    def flush(self) -> None:
        """Measure the logits kept; a failure is kept, not raised."""
        pending, self._pending = self._pending, []
        if self.error is not None:
            return
        try:
            self.calls += [logsumexp_stats(logits) for logits in pending]
        except Exception as e:
            self.error = e

    def remove(self, keep_module_hooks: bool = False) -> None:
        """Take the hook off (``keep_module_hooks``: leave it on, inert)."""
        self.inert = True
        if self._handle is not None and not keep_module_hooks:
            self._handle.remove()
            self._handle = None

    def on_device(self) -> Optional[torch.Tensor]:
        """``[mean, max]`` over the step's calls; None when none was seen or one failed."""
        self.flush()
        if self.error is not None or not self.calls:
            return None
        calls = torch.stack(self.calls)
        return torch.stack([calls[:, 0].mean(), calls[:, 1].max()])

    def from_host(self, values: np.ndarray) -> tuple[str, np.ndarray]:
        """The head and :meth:`on_device`'s values, brought to the host."""
        return self.name, values
