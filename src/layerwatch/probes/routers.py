"""Mixture-of-Experts routers on a sampled step (the ``moe`` family): which experts each token
went to, and how sure the router was.

**Found** (:func:`find_routers`) in transformers' own MoE classes: every model declares its router
class in ``_can_record_outputs["router_logits"]`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3, gpt-oss, ...). The router's sibling whose class name ends in ``Experts`` is given
each token's experts (``top_k_index``: the routing used, after any balancing bias or group limit).
A custom MoE names its routers with the ``moe_routers`` option (:class:`RouterSpec`): modules
whose output (or its first element) is the router logits ``[..., experts]``, each token sent to
its ``top_k`` largest.

**Measured**, on sampled steps only: a forward hook on each router keeps its logits and, where
the router returns them (transformers v5's ``(logits, scores, indices)``), the experts it chose
for each token: the routing before any expert-parallel dispatch. A router that returns its
logits alone has its experts' forward pre-hook keep the indices they are given. Once the forward is over (outside every module's
time), each call is reduced on the device: the tokens per expert (:func:`~layerwatch.stats.bincount`,
no host sync), and over tokens the sums of the routing entropy, of the top-1 margin and of log Z
(the logits' logsumexp), and its largest. Calls add up over the step's micro-batches. A call made
while autograd runs a backward is activation checkpointing recomputing the forward: not counted
again. Everything is one vector per router, read with the step's other probes in one transfer.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch.distributed.sharding import named_modules
from layerwatch.guards.hooks import InertHooks, is_compiling
from layerwatch.probes.result import RouterLoad
from layerwatch.probes.selection import probe_name
from layerwatch import stats as S

BIAS_NAMES = ("e_score_correction_bias", "expert_bias")  # DeepSeek-V3's (on the router), torchtitan's (on the MoE block)
_SUMS = 5  # after the counts: tokens with logits, sum of entropy, sum of margin, sum of log Z, max of log Z


class RouterSpec(NamedTuple):
    """A router of a custom MoE, named with the ``moe_routers`` option: the modules whose name
    matches ``pattern`` (a glob over ``named_modules()`` names) output the router logits
    ``[..., experts]`` (or a tuple whose first element they are), and each token goes to its
    ``top_k`` largest. ``capacity_factor``: each expert takes at most
    ``ceil(capacity_factor * tokens * top_k / experts)`` tokens of a call, the rest are dropped
    (``moe_dropped``)."""

    pattern: str
    top_k: int
    capacity_factor: Optional[float] = None


def check_routers(value: Any) -> Optional[tuple[RouterSpec, ...]]:
    """Validate the ``moe_routers`` option: None, or a mapping of module-name patterns to a
    ``top_k`` (an int) or to ``{"top_k": int, "capacity_factor": float}``."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise TypeError("moe_routers must map router module names (glob patterns) to top_k or to "
                        f"{{'top_k': int, 'capacity_factor': float}}, got {value!r}")
    specs = []
    for pattern, spec in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"moe_routers: each key must be a module name pattern, got {pattern!r}")
        given = {"top_k": spec} if not isinstance(spec, Mapping) else dict(spec)
        unknown = set(given) - {"top_k", "capacity_factor"}
        if unknown:
            raise ValueError(f"moe_routers[{pattern!r}]: unknown keys {sorted(unknown)!r} (top_k, capacity_factor)")
        top_k, factor = given.get("top_k"), given.get("capacity_factor")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"moe_routers[{pattern!r}]: top_k must be an int >= 1, got {top_k!r}")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not 0 < factor < math.inf):
            raise ValueError(f"moe_routers[{pattern!r}]: capacity_factor must be a finite number > 0, got {factor!r}")
        specs.append(RouterSpec(pattern, top_k, None if factor is None else float(factor)))
    return tuple(specs)


class Router(NamedTuple):
    """One router found in a model."""

    name: str  # the router module's (the layer of its moe_* tags)
    module: nn.Module
    experts: Optional[nn.Module]  # given each token's experts (None: its top_k largest logits, a RouterSpec's)
    num_experts: int  # 0: the logits' width (a RouterSpec's)
    top_k: int
    capacity_factor: Optional[float]
    bias: Optional[torch.Tensor]  # the aux-free balancing bias, one value per expert


def declared_router_classes(model: nn.Module) -> tuple[type, ...]:
    """The router classes transformers' models of ``model`` declare (``_can_record_outputs["router_logits"]``)."""
    found = []
    for module in model.modules():
        declared = getattr(type(module), "_can_record_outputs", None)
        recorder = declared.get("router_logits") if isinstance(declared, Mapping) else None
        target = getattr(recorder, "target_class", recorder)
        # a recorder of another output than the first (a block's, index 1) does not record a router's own logits
        if isinstance(target, type) and not getattr(recorder, "index", 0) and target not in found:
            found.append(target)
    return tuple(found)


def find_routers(model: nn.Module, specs: Optional[Sequence[RouterSpec]] = None) -> list[Router]:
    """The routers of ``model``: those ``specs`` name, then those transformers declares."""
    modules = named_modules(model)
    by_name = dict(modules)
    found: list[Router] = []
    taken: set[int] = set()
    for spec in specs or ():
        for name, module in modules:
            if id(module) not in taken and fnmatch.fnmatchcase(probe_name(name), spec.pattern):
                taken.add(id(module))
                found.append(Router(probe_name(name), module, None, 0, spec.top_k, spec.capacity_factor,
                                    _bias(module, by_name.get(name.rpartition(".")[0]))))
    classes = declared_router_classes(model)
    for name, module in modules:
        if classes and isinstance(module, classes) and id(module) not in taken:
            block = by_name.get(name.rpartition(".")[0])
            experts = _experts_beside(module, block)
            count = getattr(module, "num_experts", None) or getattr(experts, "num_experts", None)
            top_k = getattr(module, "top_k", None) or getattr(block, "top_k", None)
            if isinstance(count, int) and isinstance(top_k, int):
                taken.add(id(module))
                found.append(Router(probe_name(name), module, experts, count, top_k, None, _bias(module, block)))
    return found


def expert_modules(model: nn.Module, specs: Optional[Sequence[RouterSpec]] = None) -> list[tuple[str, nn.Module, int]]:
    """``(name, module, experts)`` of each experts module beside a router of ``model``: its fused
    parameters hold one slice per expert along their first dimension."""
    names = {id(module): name for name, module in named_modules(model)}
    return [(probe_name(names[id(r.experts)]), r.experts, r.num_experts) for r in find_routers(model, specs)
            if r.experts is not None and id(r.experts) in names]


def _experts_beside(router: nn.Module, block: Optional[nn.Module]) -> Optional[nn.Module]:
    if block is None:
        return None
    return next((m for m in block._modules.values()
                 if m is not None and m is not router and type(m).__name__.lower().endswith("experts")), None)


def _bias(router: nn.Module, block: Optional[nn.Module]) -> Optional[torch.Tensor]:
    for owner in (router, block):
        for name in BIAS_NAMES:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, torch.Tensor) and value.dim() == 1:
                return value
    return None


def _logits(output: Any) -> Optional[torch.Tensor]:
    logits = output[0] if isinstance(output, (tuple, list)) and output else output
    return logits if isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.dim() >= 1 else None


def _indices(args: tuple, kwargs: Mapping[str, Any]) -> Optional[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
            return value
    return None


def _recomputing() -> bool:
    """Whether autograd is running a backward now: a forward then is a checkpoint's recompute."""
    return torch._C._current_graph_task_id() != -1


def route_sums(logits: torch.Tensor) -> torch.Tensor:
    """``[tokens, Σ entropy, Σ top-1 margin, Σ log Z, max log Z]`` over the tokens of ``logits``
    ``[..., experts]``, in float64 (entropy of softmax(logits), nats)."""
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1]).float()
        lse = torch.logsumexp(flat, dim=-1)
        log_p = flat - lse[:, None]
        p = log_p.exp()
        entropy = -torch.xlogy(p, p).sum(-1)  # 0 log 0 = 0; a NaN logit's token stays NaN
        top = p.topk(min(2, flat.shape[-1]), dim=-1).values
        margin = top[:, 0] - top[:, 1] if top.shape[-1] > 1 else top[:, 0]
        tokens = torch.full((), flat.shape[0], dtype=torch.float64, device=flat.device)
        return torch.stack([tokens, entropy.double().sum(), margin.double().sum(), lse.double().sum(),
                            lse.max().double()])


class _Kept:
    """One router's calls on a sampled step: pending (kept by the hooks) and reduced."""

    __slots__ = ("router", "routed", "logits", "indices", "counts", "sums", "dropped")

    def __init__(self, router: Router) -> None:
        self.router = router
        self.routed = False  # the router's own output holds the indices (then the experts' pre-hook stands by)
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.counts: Optional[torch.Tensor] = None
        self.sums: Optional[torch.Tensor] = None
        self.dropped: Optional[torch.Tensor] = None

    def reduce(self) -> None:
        logits, self.logits = self.logits, []
        indices, self.indices = self.indices, []
        router = self.router
        for call in logits:
            if not call.numel():  # a call that routed no token
                continue
            sums = route_sums(call)
            self.sums = sums if self.sums is None else torch.cat([self.sums[:4] + sums[:4],
                                                                  torch.maximum(self.sums[4:], sums[4:])])
            if router.experts is None:  # a RouterSpec's: its top_k largest
                flat = call.detach().reshape(-1, call.shape[-1])
                self._count(flat.topk(router.top_k, dim=-1).indices, flat.shape[-1])
        for chosen in indices:
            self._count(chosen.detach(), router.num_experts)

    def _count(self, chosen: torch.Tensor, experts: int) -> None:
        chosen = chosen.reshape(-1).long()
        # an index out of [0, E) (a padding token's -1) goes to a bin of its own, left out: no device assert, no sync
        chosen = torch.where((chosen >= 0) & (chosen < experts), chosen, experts)
        counts = S.bincount(chosen, experts + 1)[:experts]
        router = self.router
        if router.capacity_factor is not None:
            tokens = chosen.shape[0] // router.top_k
            capacity = math.ceil(router.capacity_factor * tokens * router.top_k / experts)
            over = (counts - capacity).clamp(min=0).sum()
            self.dropped = over if self.dropped is None else self.dropped + over
        self.counts = counts if self.counts is None else self.counts + counts


class RouterProbe(InertHooks):
    """The routers' hooks of one sampled step (see the module); ``remove()`` is safe twice."""

    def __init__(self, routers: Sequence[Router]) -> None:
        super().__init__()
        self.kept = [_Kept(router) for router in routers]
        self.error: Optional[BaseException] = None
        self._after: Optional[Callable[[Any], None]] = None

    def hook(self, after: Optional[Callable[[Any], None]] = None) -> None:
        """The routers' forward hooks and their experts' pre-hooks; ``after(self)`` after each
        experts call (the re-run measures at once)."""
        self._after = after
        for kept in self.kept:
            router = kept.router
            self._handles.append(router.module.register_forward_hook(self._router_hook(kept)))
            if router.experts is not None:
                self._handles.append(router.experts.register_forward_pre_hook(self._experts_hook(kept), with_kwargs=True))

    def _router_hook(self, kept: _Kept) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if is_compiling() or self.inert or _recomputing():
                return
            logits = _logits(output)
            if logits is None:
                return
            kept.logits.append(logits)
            chosen = _indices(output[1:], {}) if kept.router.experts is not None and isinstance(output, tuple) else None
            if chosen is not None:
                kept.routed = True
                kept.indices.append(chosen)
            if (chosen is not None or kept.router.experts is None) and self._after is not None:
                self._after(self)
        return hook

    def _experts_hook(self, kept: _Kept) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if kept.routed or is_compiling() or self.inert or _recomputing():
                return
            chosen = _indices(args, kwargs)
            if chosen is not None:
                kept.indices.append(chosen)
                if self._after is not None:
                    self._after(self)
        return hook

    def flush(self) -> None:
        """Reduce the calls kept; a failure is kept, not raised."""
        if self.error is not None:
            return
        try:
            for kept in self.kept:
                kept.reduce()
        except Exception as e:
            self.error = e

    def on_device(self) -> Optional[torch.Tensor]:
        """Every router's vector, one after another (:meth:`from_host` splits them): the tokens
        per expert, the sums of :func:`route_sums`, the dropped tokens, the bias; None when no
        router was called or one failed."""
        self.flush()
        if self.error is not None:
            return None
        parts = []
        for kept in self.kept:
            if kept.counts is None:
                continue
            device = kept.counts.device
            sums = kept.sums if kept.sums is not None else torch.zeros(_SUMS, dtype=torch.float64, device=device)
            dropped = kept.dropped if kept.dropped is not None else torch.zeros((), dtype=torch.int64, device=device)
            bias = kept.router.bias
            parts += [kept.counts.double(), sums.to(device), dropped.double().reshape(1)]
            if bias is not None:
                parts.append(bias.detach().double().to(device))
        if not parts:
            return None
        devices = {part.device for part in parts}
        if len(devices) > 1:  # routers on several devices (a model split by hand): gathered where the first is
            parts = [part.to(parts[0].device) for part in parts]
        return torch.cat(parts)

    def from_host(self, values: np.ndarray) -> dict[str, "Routed"]:
        """Each called router's :class:`Routed`, from :meth:`on_device`'s vector brought to the host."""
        out, at = {}, 0
        for kept in self.kept:
            if kept.counts is None:
                continue
            router, experts = kept.router, kept.counts.shape[0]
            counts, sums = values[at:at + experts], values[at + experts:at + experts + _SUMS]
            at += experts + _SUMS + 1
            dropped = values[at - 1] if router.capacity_factor is not None else None
            bias = None
            if router.bias is not None:
                bias, at = values[at:at + experts], at + experts
            out[router.name] = Routed(counts, sums, dropped, bias, router.top_k)
        return out


class Routed(NamedTuple):
    """One router's step on one rank, on the host: the tokens per expert, :func:`route_sums`
    added over its calls (the largest log Z, the largest), the tokens dropped (None: no
    capacity limit), the balancing bias (None: none) and the experts each token is sent to."""

    counts: np.ndarray
    sums: np.ndarray
    dropped: Optional[float] = None
    bias: Optional[np.ndarray] = None
    top_k: Optional[int] = None

    def plus(self, other: "Routed") -> "Routed":
        """Both ranks' steps: counts and sums added by expert before any ratio, the largest log Z
        taken; the bias and top_k are this rank's (every rank holds the same)."""
        sums = np.concatenate([self.sums[:-1] + other.sums[:-1], np.maximum(self.sums[-1:], other.sums[-1:])])
        dropped = None if self.dropped is None else self.dropped + (other.dropped or 0.0)
        return Routed(self.counts + other.counts, sums, dropped, self.bias, self.top_k)

    def load(self) -> RouterLoad:
        """What is logged of it."""
        tokens, entropy, margin, z_sum, z_max = self.sums.tolist()
        means = [value / tokens for value in (entropy, margin, z_sum)] if tokens else [None] * 3
        return RouterLoad(self.counts.astype(np.int64), means[0], means[1], means[2], z_max if tokens else None,
                          None if self.dropped is None else int(self.dropped), self.bias, self.top_k)


class Combined(NamedTuple):
    """Every rank's routers, combined (:func:`combine`), and what was left out and why."""

    loads: dict[str, RouterLoad]
    uneven: list[str]  # routers whose ranks count a different number of experts: left out
    missing: list[str]  # routers some rank did not measure (its probe failed): left out
    repeated: bool  # ranks that routed the same tokens (tensor parallel) were counted once


def combine(parts: Sequence[Optional[Mapping[str, Routed]]]) -> Combined:
    """Each router's :class:`RouterLoad` over every rank's ``parts`` (a rank's None: it measured
    none), its counts and sums added by expert over the ranks that routed their own tokens. Ranks
    whose counts and sums are the same to the bit routed the same tokens (tensor parallel ranks
    share a batch) and count once. A router not every rank measured, or whose ranks count a
    different number of experts (expert parallel with a router per rank's experts), is left out:
    exact or absent."""
    each: dict[str, list[Routed]] = {}
    for part in parts:
        for name, routed in (part or {}).items():
            each.setdefault(name, []).append(routed)
    loads: dict[str, RouterLoad] = {}
    uneven, missing, repeated = [], [], False
    for name, routed in each.items():
        if len(routed) < len(parts):
            missing.append(name)
        elif len({r.counts.shape for r in routed}) > 1:
            uneven.append(name)
        else:
            distinct = list({(r.counts.tobytes(), r.sums.tobytes()): r for r in routed}.values())
            repeated = repeated or len(distinct) < len(routed)
            total = distinct[0]
            for other in distinct[1:]:
                total = total.plus(other)
            loads[name] = total.load()
    return Combined(loads, uneven, missing, repeated)
