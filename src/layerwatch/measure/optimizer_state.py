"""Adam's own state, per parameter tensor, on sampled steps: the shape of its updates.

For torch's ``Adam`` and ``AdamW`` (plain, foreach and fused; ``amsgrad`` too), with ``m`` and
``v`` its moments, ``m̂ = m / (1 - β1^t)`` and ``v̂ = v / (1 - β2^t)``:

- **the normalized update RMS**, ``RMS(m̂ / (√v̂ + ε))``: the update per unit of learning rate,
  after the step. About 0.2-0.3 when the gradients are mostly noise; 1 when every coordinate
  moves by the learning rate, as ``sign(g)`` would (Molybog et al. 2023 tie that to
  divergence); near 0 when ε outweighs ``√v̂``;
- **the ε-bound fraction**: of the coordinates with a gradient at this step (``g ≠ 0``: an
  embedding's rows absent from the batch are not judged), the share with ``√v̂ < 10ε``, where
  ε, not the gradient, sets the step (Wortsman et al. 2023);
- **the gradient-spike fraction**: of the coordinates with a gradient and ``v > 0`` before the
  step, the share whose new gradient has ``g² > θ·v̂`` (θ = ``SPIKE_FACTOR``, SPAM's 5000; ``v̂`` bias
  corrected, so the first steps, whose ``v`` is still small, are judged alike). It must be
  read before the step: after it, ``g²/v ≤ 1/(1 - β2)`` and the rule could never fire.

Each is a sum over coordinates (``ROW``), so a sharded tensor's are summed over its ranks
and read whole; the fractions are made on the host by :func:`update_stats` and :func:`spike_fractions`, their one home.
The work per group of tensors is a fixed number of ``torch._foreach_*`` calls, whatever the
number of tensors; nothing is read on the host before the step's single transfer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch import vocabulary as V
from layerwatch.distributed.sharding import is_writer_rank, local
from layerwatch import stats as S
from layerwatch.stats.batched import to_device

SPIKE_FACTOR = 5000.0  # SPAM (Huang et al. 2025): a coordinate's g² above this many times its v
EPS_FACTOR = 10.0  # ε-bound: √v̂ below this many times ε

# The columns of a row after the step (one per tensor), and of one before it; the last column
# of either is above 0 where a rank could not read its part of a sharded tensor.
UPDATE_SUMSQ, VALUES, EPS_BOUND, SEEN, FAILED = range(5)
SPIKES, JUDGED, _ = range(3)
WIDTH = {S.ADAM_ROWS: 5, S.ADAM_SPIKE_ROWS: 3}  # the families of a sample's rows these make

Group = tuple[Any, list[str], list[torch.Tensor]]  # (process group or None, names, tensors)


def adam_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The torch ``Adam`` (or ``AdamW``) inside ``optimizer`` and the wrappers the front doors
    hand over (Lightning's ``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``), or
    None when it is another optimizer."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
            return optimizer
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            return None
        optimizer = inner
    return None


def failed(rows: np.ndarray) -> np.ndarray:
    """Which rows (of either kind) a rank could not help read."""
    return rows[:, -1] > 0


def update_stats(rows: np.ndarray) -> dict[str, np.ndarray]:
    """The series of rows read after the step: ``adam_update_rms`` and ``adam_eps_frac`` (NaN
    where no coordinate has had a gradient)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        seen = rows[:, SEEN]
        return {V.ADAM_UPDATE_RMS: np.sqrt(rows[:, UPDATE_SUMSQ] / rows[:, VALUES]),
                V.ADAM_EPS_FRAC: np.where(seen > 0, rows[:, EPS_BOUND] / seen, np.nan)}


def spike_fractions(rows: np.ndarray) -> np.ndarray:
    """``adam_spike_frac`` of rows read before the step (NaN where no coordinate was judged)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(rows[:, JUDGED] > 0, rows[:, SPIKES] / rows[:, JUDGED], np.nan)


def _bias_corrections(states: list[dict], settings: list[dict], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``1 − β1^t`` and ``1 − β2^t`` of each tensor, ``t`` its step count now (float64, on ``device``).
    Steps on the host (Adam's default) are worked out there and copied without a wait; steps on
    the device (``capturable``, ``fused``) stay there: nothing waits for the device either way."""
    steps = torch.stack([torch.as_tensor(s["step"]) for s in states]).to(torch.float64)
    betas = torch.tensor([g["betas"] for g in settings], dtype=torch.float64)
    if steps.device.type == "cpu":
        return tuple(to_device(1 - betas ** steps[:, None], torch.float64, device).unbind(1))  # type: ignore[return-value]
    betas = to_device(betas, torch.float64, steps.device)
    return 1 - betas[:, 0] ** steps, 1 - betas[:, 1] ** steps


def _nonzero(tensors: list[torch.Tensor]) -> torch.Tensor:
    """How many values of each tensor are not zero (one pass each, nothing allocated)."""
    return torch.stack(torch._foreach_norm(tensors, 0)).to(torch.float64)


class AdamState:
    """Reads the rows of :mod:`this module <layerwatch.measure.optimizer_state>` for the parameters an
    optimizer steps, through the groups ``groups`` makes (:meth:`ParameterFamilies.groups
    <layerwatch.measure.params.ParameterFamilies.groups>`: by device, and sharded tensors by their
    process group, checked to be the same on every rank)."""

    def __init__(self, groups: Callable[[Sequence[tuple[str, torch.Tensor]], str], list[Group]],
                 say_once: Callable[[str, str], None]) -> None:
        self.groups = groups
        self.say_once = say_once

    def _adam(self, optimizer: Any) -> Optional[torch.optim.Optimizer]:
        """The Adam in ``optimizer``; None, said once, for another optimizer. The same optimizer
        on every rank: where it is not an Adam, none of them takes the groups' collective."""
        adam = adam_optimizer(optimizer)
        if adam is None and optimizer is not None and is_writer_rank():
            self.say_once(f"not-adam:{type(optimizer).__name__}", (
                f"layerwatch: the optimizer-state signals (adam_update_rms, adam_eps_frac, adam_spike_frac) cover "
                f"torch's Adam and AdamW; {type(optimizer).__name__}'s state is not read"))
        return adam

    def before_step(self, optimizer: Any, params: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[list[str], torch.Tensor]]:
        """Rows ``[SPIKES, JUDGED, FAILED]`` of the parameters ``optimizer`` is about to step, their
        gradients final and their ``v`` still the last step's."""
        return self._read(optimizer, params, S.ADAM_SPIKE_ROWS, self._spikes)

    def after_step(self, optimizer: Any, params: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[list[str], torch.Tensor]]:
        """Rows ``[UPDATE_SUMSQ, VALUES, EPS_BOUND, SEEN, FAILED]`` of the parameters ``optimizer`` has stepped."""
        return self._read(optimizer, params, S.ADAM_ROWS, self._update)

    def _read(self, optimizer: Any, params: Sequence[tuple[str, nn.Parameter]], family: str,
              measure: Callable[[list[dict], list[dict], list[Optional[torch.Tensor]]], torch.Tensor]
              ) -> list[tuple[list[str], torch.Tensor]]:
        """``measure(states, settings, grads)`` of the parameters ``optimizer`` holds moments of (and,
        before the step, a gradient of), per group, as rows of ``family``."""
        adam = self._adam(optimizer)
        if adam is None:
            return []
        graded = family == S.ADAM_SPIKE_ROWS
        found = {name: p for name, p in params if "exp_avg_sq" in adam.state.get(p, ()) and (p.grad is not None or not graded)}
        settings = {id(p): g for g in adam.param_groups for p in g["params"]} if found else {}
        pieces = []
        for group, names, tensors in self.groups(list(found.items()), "optimizer state"):
            owned = [found[name] for name in names]
            rows_of = lambda: measure([adam.state[p] for p in owned], [settings[id(p)] for p in owned],  # noqa: E731
                                      [p.grad for p in owned])
            pieces.append((names, self._all(group, rows_of, len(names), WIDTH[family], tensors)))
        return pieces

    @staticmethod
    def _all(group: Any, rows_of: Callable[[], torch.Tensor], count: int, width: int, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``rows_of()``, summed over the ranks of ``group`` (every rank calls it, whatever it
        could read: a rank that failed sends zeros and a FAILED mark, which every rank then reads)."""
        if group is None:
            return rows_of()
        import torch.distributed as dist

        try:
            rows = rows_of()
        except Exception:  # take part all the same
            rows = torch.zeros(count, width, dtype=torch.float64, device=local(tensors[0]).device)
            rows[:, -1] = 1.0
        dist.all_reduce(rows, group=group)
        return rows

    @staticmethod
    def _spikes(states: list[dict], settings: list[dict], grads: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """``[SPIKES, JUDGED, FAILED]``: of the coordinates with a gradient and ``v > 0``, how many have ``g² > θ·v̂``.
        Counted as nonzero values (``_foreach_norm`` of order 0): a product is nonzero where each factor is
        (short of an underflow below float32's smallest subnormal, 1.4e-45)."""
        with torch.no_grad():
            grads = [local(g).detach() for g in grads]
            v = [local(s["exp_avg_sq"]) for s in states]
            _, bc2 = _bias_corrections(states, settings, v[0].device)
            excess = torch._foreach_mul(grads, grads)  # (g²·(1 − β2^t)/θ − v)₊ · v: nonzero where a spike is judged
            torch._foreach_mul_(excess, list((bc2 / SPIKE_FACTOR).to(excess[0].dtype).unbind()))
            torch._foreach_sub_(excess, v)
            torch._foreach_clamp_min_(excess, 0.0)
            torch._foreach_mul_(excess, v)
            spikes = _nonzero(excess)
            torch._foreach_mul_(excess, 0.0)
            torch._foreach_addcmul_(excess, grads, v)  # g · v: nonzero where judged
            judged = _nonzero(excess)
            return torch.stack([spikes, judged, torch.zeros_like(spikes)], dim=1)

    @staticmethod
    def _update(states: list[dict], settings: list[dict], grads: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """``[UPDATE_SUMSQ, VALUES, EPS_BOUND, SEEN, FAILED]`` from the moments after the step;
        ``SEEN`` counts the coordinates with a gradient (``v > 0`` where the gradient is gone)."""
        with torch.no_grad():
            m = [local(s["exp_avg"]) for s in states]
            v = [local(s["max_exp_avg_sq"] if g["amsgrad"] else s["exp_avg_sq"]) for s, g in zip(states, settings)]
            present = [vi if g is None else local(g).detach() for g, vi in zip(grads, v)]
            device, dtype = m[0].device, v[0].dtype
            bc1, bc2 = _bias_corrections(states, settings, device)
            eps = to_device([g["eps"] for g in settings], torch.float64, device)
            below = torch._foreach_neg(v)  # ((10ε)²·(1 − β2^t) − v)₊ · g: nonzero where ε-bound, with a gradient
            torch._foreach_add_(below, list(((EPS_FACTOR * eps) ** 2 * bc2).to(dtype).unbind()))
            torch._foreach_clamp_min_(below, 0.0)
            torch._foreach_mul_(below, present)
            eps_bound, seen = _nonzero(below), _nonzero(present)
            del below
            root = torch._foreach_sqrt(v)  # √v̂ + ε = √v / √(1 − β2^t) + ε
            torch._foreach_div_(root, list(bc2.sqrt().to(dtype).unbind()))
            torch._foreach_add_(root, list(eps.to(dtype).unbind()))
            torch._foreach_div_(root, m)  # (√v̂ + ε) / m: its reciprocal's norm is the update's
            torch._foreach_reciprocal_(root)
            norms = torch.stack(torch._foreach_norm(root)).to(torch.float64)
            values = to_device([t.numel() for t in m], torch.float64, device)
            sumsq = (norms / bc1) ** 2
            return torch.stack([sumsq, values, eps_bound, seen, torch.zeros_like(values)], dim=1)
