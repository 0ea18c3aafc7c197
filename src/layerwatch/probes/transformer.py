"""The transformer signals of one sampled step's forward: each attention call's heads
(:mod:`~layerwatch.probes.attention`), the output head's log Z (:mod:`~layerwatch.probes.logits`),
each block output's per-channel kurtosis (:mod:`~layerwatch.probes.kurtosis`) and each
Mixture-of-Experts router's routing (:mod:`~layerwatch.probes.routers`), armed and
taken together beside the runtime probe, on every eager forward that is measured: a sampled
step's, or a compiled model's re-run (:mod:`~layerwatch.engine.rerun`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

from torch import nn

from layerwatch.vocabulary import Family
from layerwatch.distributed.agreement import RankSync
from layerwatch.distributed.sharding import global_rank, innermost, is_writer_rank
from layerwatch.guards.failures import FailurePolicy
from layerwatch.guards.hooks import is_compiling
from layerwatch.probes.attention import AttentionProbe, combine_heads
from layerwatch.probes.kurtosis import ChannelKurtosis
from layerwatch.probes.logits import OutputLogits, find_output_head
from layerwatch.probes.result import Signals
from layerwatch.probes.routers import Combined, Router, RouterProbe, RouterSpec, combine, find_routers
from layerwatch.probes.selection import probe_names
from layerwatch.stats import to_host


EXPERT_PARALLEL = (
    "layerwatch: the model's experts are split over ranks (expert parallel): each router's tokens per expert are "
    "its own choices before they are dispatched, added over the ranks that route their own batches; each expert's "
    "weight rows (<param>[e]) are read where its shard lies. This set-up is not among layerwatch's tested ones"
)


class TransformerProbes:
    """The ``attention`` and ``logits`` families' probes, and the kurtosis of the
    ``activations``; ``remove()`` is safe twice.

    The kurtosis is of the blocks' outputs (the probed modules with children: a transformer's
    blocks, attention, MLP), not of every leaf: a hook per leaf would cost a sample of a
    1,000-layer chain 8 Python calls a layer. A pre-hook and an always-called hook on the model
    and on each of its children that has children of its own (a LightningModule's
    ``training_step`` may call its model alone), counted, tell when the forward
    begins (the attention wrapper stands in) and when it is over (torch's function is back, and
    what the probes kept is measured: after the runtime probe closed every module's span, whose
    hooks came first, so no module's ``fwd_ms`` holds this work, on the host or the device).

    With ``aside`` (a compiled model's re-run: autograd is off, so nothing else keeps a module's
    output or an attention call's inputs) each is measured as it comes, and ``aside`` leaves that
    work out of the modules' time: the re-run holds no more than one module's outputs at a time.
    """

    def __init__(self, families: Sequence[str], output_head: Optional[str], failures: FailurePolicy,
                 moe_routers: Optional[Sequence[RouterSpec]] = None) -> None:
        self.attention_on, self.logits_on = Family.ATTENTION in families, Family.LOGITS in families
        self.kurtosis_on, self.moe_on = Family.ACTIVATIONS in families, Family.MOE in families
        self.output_head, self.failures, self.moe_routers = output_head, failures, moe_routers
        self._armed: Optional[object] = None  # this arming's token (see arm)
        self._attention: Optional[AttentionProbe] = None
        self._logits: Optional[OutputLogits] = None
        self._kurtosis: Optional[ChannelKurtosis] = None
        self._routers: Optional[RouterProbe] = None
        self._found: Optional[tuple[int, list[Router]]] = None  # (the model's id, its routers): found once
        self._handles: list[Any] = []
        self._inert: list[Any] = []  # hooks and probes kept, inert (see remove)
        self._depth = 0
        self._aside: Optional[Callable[[Callable[[], None]], None]] = None

    def arm(self, model: nn.Module, modules: Sequence[tuple[str, nn.Module]],
            aside: Optional[Callable[[Callable[[], None]], None]] = None, dense_limit: Optional[int] = None) -> None:
        """This step's probes, on an eager forward of ``model`` whose probed ``modules`` are these;
        ``aside`` and ``dense_limit`` (a re-run's) as the class and :class:`AttentionProbe` say."""
        self._aside = aside
        routers = self._find_routers(model) if self.moe_on else []  # named as the probed modules are (a DDP's module.)
        model = innermost(model)  # a compiled or DDP wrapper's module: its blocks run its forward
        names = probe_names(modules)
        if self.attention_on:
            self._attention = AttentionProbe({id(module): name for name, (_, module) in zip(names, modules)}, aside,
                                             dense_limit)
        head = self._find_head(model) if self.logits_on else None
        if head is not None:
            self._logits = OutputLogits(head[0])
            self._logits.hook(head[1], self._measured_now)
        if self.kurtosis_on:
            self._kurtosis = ChannelKurtosis()
            # _modules, not children(): a generator a module would cost a 1,000-layer chain's sample 3 calls a layer
            self._kurtosis.hook([(name, module) for name, (_, module) in zip(names, modules) if module._modules],
                                self._measured_now)
        if routers:
            self._routers = RouterProbe(routers)
            self._routers.hook(self._measured_now)
        self._depth = 0
        self._armed = armed = object()  # hooks of an earlier arming, kept inert, are not this one's
        entries = [model] + [module for module in model._modules.values() if module is not None and module._modules]
        begins, ends = functools.partial(self._begins, armed), functools.partial(self._ends, armed)
        self._handles = [handle for module in entries
                         for handle in (module.register_forward_pre_hook(begins),
                                        module.register_forward_hook(ends, always_call=True))]

    def _find_routers(self, model: nn.Module) -> list[Router]:
        if self._found is None or self._found[0] != id(model):
            routers = find_routers(model, self.moe_routers)
            if self.moe_routers and not any(r.experts is None for r in routers):
                self.failures.warn_once("no-moe-routers", f"layerwatch: moe_routers={[s.pattern for s in self.moe_routers]!r} "
                                        "names no module of the model; those routers are not measured")
            config = getattr(getattr(innermost(model), "config", None), "distributed_config", None)
            if routers and getattr(config, "ep_size", 1) > 1 and is_writer_rank():
                self.failures.say_once("moe-expert-parallel", EXPERT_PARALLEL)
            self._found = (id(model), routers)
        return self._found[1]

    def _measured_now(self, probe: Any) -> None:
        """After a hook kept an output: with ``aside`` (the re-run), measured at once, outside the modules' time."""
        if self._aside is not None:
            self._aside(probe.flush)

    def _begins(self, armed: object, module: nn.Module, args: tuple) -> None:
        if is_compiling() or armed is not self._armed:  # traced by Dynamo (a compiled caller), or kept inert: nothing
            return
        self._depth += 1
        if self._attention is not None:
            self._attention.start()

    def _ends(self, armed: object, module: nn.Module, args: tuple, output: Any) -> None:
        if is_compiling() or armed is not self._armed:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        self._depth = 0
        if self._attention is not None:
            self._attention.stop()
        for probe in (self._attention, self._logits, self._kurtosis, self._routers):
            if probe is not None:
                probe.flush()

    def _find_head(self, model: nn.Module) -> Optional[tuple[str, nn.Module]]:
        head = find_output_head(model, self.output_head)
        if head is None and self.output_head is not None:
            self.failures.warn_once("no-output-head", f"layerwatch: output_head={self.output_head!r} names no module "
                                    "of the model; the output logits are not measured")
        return head

    def unhook(self) -> None:
        """Take the hooks off and put torch's functions back, keeping what was measured (for :meth:`take`)."""
        self._armed = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for probe in (self._attention, self._logits, self._kurtosis, self._routers):
            if probe is not None:
                probe.remove()

    def remove(self, keep_module_hooks: bool = False) -> None:
        """Take the hooks off (``keep_module_hooks``: leave them on, inert, until :meth:`release`;
        see StepProbes)."""
        self._armed = None
        if keep_module_hooks:
            self._inert += self._handles + [probe for probe in (self._logits, self._kurtosis, self._routers)
                                            if probe is not None]
        else:
            for handle in self._handles:
                handle.remove()
        self._handles = []
        for probe in (self._attention, self._logits, self._kurtosis, self._routers):
            if probe is not None:
                probe.remove(keep_module_hooks)
        self._attention = self._logits = self._kurtosis = self._routers = None

    def release(self) -> None:
        """Remove the hooks kept inert too, and forget the routers found (the run is over: the
        model's modules are not held)."""
        self.remove()
        self._found = None
        for kept in self._inert:
            kept.remove()
        self._inert = []

    def take(self, sync: Optional[RankSync] = None, keep_module_hooks: bool = False) -> Signals:
        """The step's :class:`~layerwatch.probes.result.Signals`: attention (module -> ``[heads,
        2]``), output logits (the head, ``[mean, max]`` of log Z), kurtosis (module -> its
        output's) and routers (router -> ``RouterLoad``), brought to the host together (one
        transfer per device).

        With ``sync`` (a sharded run: every rank calls this at every sampled step) the ranks
        exchange their attention and their routers' counts (one gather of host values, every
        rank, whatever its own probes did). A module whose heads are split over ranks (tensor
        parallel) gets every rank's heads, in order; one whose ranks do not all have it is left
        out, said once. A router's counts and sums are added over the ranks by expert (each data
        parallel rank routes its own batch). Each rank's other values are its own, as its
        activations' are (data parallel ranks: its micro-batch)."""
        attention, logits, kurtosis, routers = self._attention, self._logits, self._kurtosis, self._routers
        self.remove(keep_module_hooks)  # keeps what each measured; on_device() measures what is left
        probes = (attention, logits, kurtosis, routers)
        taken = [(probe, probe.on_device()) for probe in probes if probe is not None]
        for probe, what in ((attention, "attention"), (logits, "the output logits"), (routers, "the MoE routers")):
            if probe is not None and probe.error is not None:
                self.failures.warn_once(f"fail:{what}", f"layerwatch: could not measure {what}: {probe.error!r}; skipped")
        if attention is not None and attention.unmeasured and is_writer_rank():
            self.failures.say_once("attention-flex", "layerwatch: FlexAttention's kernel here returns neither each "
                                   "row's largest score nor its logsumexp (its FLASH backend; the CPU's and MPS's, "
                                   "inference only in torch 2.13): its calls' attention is not measured")
        taken = [(probe, values) for probe, values in taken if values is not None]
        found = {id(probe): probe.from_host(values) for (probe, _), values in zip(taken, to_host([v for _, v in taken]))}
        heads, routed = found.get(id(attention), {}), found.get(id(routers))
        if sync is not None and (self.attention_on or self.moe_on):
            heads, parts = self._gather(sync, heads, attention, routed, routers)
        else:
            heads, parts = {name: values[:, :2] for name, values in heads.items()}, [routed]
        return Signals(heads, found.get(id(logits)), found.get(id(kurtosis), {}), self._routers_of(parts))

    def _routers_of(self, parts: list) -> dict:
        """The routers' loads over every rank's ``parts`` (:func:`~layerwatch.probes.routers.combine`);
        what it leaves out, said once by the rank that writes."""
        combined: Combined = combine(parts)
        if is_writer_rank():
            if combined.uneven:
                self.failures.say_once("moe-uneven", "layerwatch: the ranks count a different number of experts for "
                                       + ", ".join(combined.uneven[:3]) + " (expert parallel, each rank's router over "
                                       "its own experts?): their routers are left out")
            if combined.missing:
                self.failures.say_once("moe-missing", "layerwatch: not every rank measured the routers "
                                       + ", ".join(combined.missing[:3]) + " (a rank's probe failed): left out")
            if combined.repeated:
                self.failures.say_once("moe-repeated", "layerwatch: ranks routed the same tokens (tensor parallel "
                                       "ranks share a batch): their routers' tokens are counted once")
        return combined.loads

    def _gather(self, sync: RankSync, heads: dict[str, Any], attention: Optional[AttentionProbe],
                routed: Optional[dict], routers: Optional[RouterProbe]) -> tuple[dict[str, Any], list]:
        """Every rank's attention heads and routers' counts, in one gather: the heads combined,
        and each rank's routers (for :func:`~layerwatch.probes.routers.combine`)."""
        mine_heads = None if attention is None or attention.error is not None else {
            name: (attention.split.get(name), values) for name, values in heads.items()}
        mine_routed = None if routers is None or routers.error is not None else routed
        parts = sync.all((mine_heads, mine_routed))
        combined, left_out = combine_heads([heads for heads, _ in parts], global_rank())
        if left_out and is_writer_rank():
            self.failures.say_once("attention-ranks", "layerwatch: the attention of " + ", ".join(left_out[:3])
                                   + " is split over ranks that did not all measure it; left out")
        return combined, [routed for _, routed in parts]
