"""The plain-PyTorch engine: samples a model's weights and gradients on a schedule.

Off-steps cost a counter increment and one schedule lookup: no hook exists, no tensor
is touched. On a sampled step the optimizer hooks (when an optimizer is given) are
armed, every parameter and gradient is reduced where it lives (``stats.reduce``), the
results of the whole step travel to the host in one transfer per device, and the
record is written as one TensorBoard event. The hooks are removed again before
``step()`` returns.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Optional, Sequence

import numpy as np
import torch
from torch import nn

from layerwatch import record as R
from layerwatch import stats as S
from layerwatch.alerts import Alert, AlertRules, HealthMonitor, alerts_markdown, all_zero
from layerwatch.probes import (
    PROBE_FAMILIES,
    ModuleFilter,
    ProbeResult,
    RuntimeProbe,
    check_module_filter,
    is_compiled,
    select_modules,
)
from layerwatch.schedule import Schedule, ScheduleLike, as_schedule, every_n_steps as every_n
from layerwatch.sentinel import Finding, NonfiniteSentinel
from layerwatch.sinks.tensorboard import TensorBoardSink
from layerwatch.structure import StructureProbe, Summary

DEFAULT_EVERY_N_STEPS = 50
DEFAULT_STATS = ("norm", "nonfinite")

logger = logging.getLogger("layerwatch")
logger.addHandler(logging.NullHandler())  # a library logs; the application decides where it goes


_Piece = tuple[list[str], torch.Tensor]  # names, and their packed rows on one device


@dataclass
class _Sample:
    """What a sampled step has gathered so far: device tensors until ``step()``."""

    step: int
    overhead_s: float = 0.0
    grads: Optional[list[_Piece]] = None
    weights: Optional[list[_Piece]] = None
    before: Optional[list[tuple[Any, list[str], list[torch.Tensor], torch.Tensor]]] = None
    update: Optional[list[_Piece]] = None
    stepped: bool = False  # the optimizer's step ran (its post-hook fired)


class Inspector:
    """Logs per-parameter weight and gradient statistics and histograms to TensorBoard.

    Call :meth:`step` once per optimizer step, after ``optimizer.step()``. The first
    call closes step 0; step ``k`` is sampled when the schedule says so (by default
    ``k % every_n_steps == 0``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from layerwatch import Inspector
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with Inspector(model, log_dir="runs/example", every_n_steps=2, optimizer=opt) as inspector:
        ...     for _ in range(4):
        ...         loss = model(torch.randn(16, 4)).pow(2).mean()
        ...         opt.zero_grad(); loss.backward(); opt.step()
        ...         inspector.step()

    Args:
        model: The module to watch. Held by weak reference.
        writer: A ``SummaryWriter`` to write into (flushed, never closed). Exclusive
            with ``log_dir``.
        log_dir: Directory for a ``SummaryWriter`` the inspector owns and closes.
            With neither, ``SummaryWriter()``'s default ``runs/...`` directory.
        every_n_steps: Sample step ``k`` when ``k % every_n_steps == 0``. Default 50.
        schedule: Instead of ``every_n_steps``: a :class:`~layerwatch.schedule.Schedule`,
            a list of steps, or a callable ``step -> bool``.
        optimizer: When given, gradients are read just before ``optimizer.step()`` and
            weights just after it, and ``update_ratio/<param>`` is logged. Its hooks
            exist only during sampled steps.
        families: Which families to log (all by default). Per parameter: ``"weights"``,
            ``"grads"``, ``"updates"``. Once: ``"structure"``, the layer table
            (``layerwatch/structure``) and the parameter and MAC counts, from the forward
            of the first sampled step. Per module, by hooks that exist only during a
            sampled step: ``"latency"`` (``fwd_ms``, ``bwd_ms``), ``"memory"``
            (``activation_bytes``, ``saved_bytes``, ``cuda_alloc_bytes``),
            ``"activations"`` (histograms and stats of module outputs) and
            ``"nonfinite"`` (NaN/Inf flags and the first offender).
        stats: Per-tensor scalars to log for weights and grads, from
            ``mean std min max norm zero_frac nonfinite``.
        histograms: Log ``weights/<param>`` and ``grads/<param>`` histograms.
        histogram_bins: Buckets per histogram, 2 to 254 (default 32, as TensorBoard's own
            default of 30; each bucket adds 16 bytes to the event file and to its write).
        alerts: Health alerts (dead, stuck, exploding, vanishing, nonfinite layers):
            ``True`` for the default :class:`~layerwatch.AlertRules`, an ``AlertRules`` with
            your thresholds, or ``False`` for none. See :attr:`alerts`.
        modules: Restrict the per-module families to modules whose qualified name matches
            one of these glob patterns (``"blocks.*.attn"``; the model itself is
            ``"(root)"``) or that are instances of one of these types (``nn.Linear``).
            Default: every module.
        sentinel: Check the gradients for NaN/Inf on every step (one fused reduction,
            read without stalling the device); on the first hit log
            ``layerwatch/first_nonfinite_step``, warn, and sample the next step with every
            probe armed. Pass ``optimizer=`` when a GradScaler may skip steps, so its
            overflow steps are told apart from faults.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``optimizer`` not an optimizer,
            or ``writer`` lacks the ``SummaryWriter`` interface.
        ValueError: A bad option value, both ``writer`` and ``log_dir``, both
            ``every_n_steps`` and ``schedule``, or a ``log_dir`` that cannot be written.
    """

    def __init__(
        self,
        model: nn.Module,
        writer: Any = None,
        *,
        log_dir: Optional[str | os.PathLike] = None,
        every_n_steps: Optional[int] = None,
        schedule: Optional[ScheduleLike] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        families: Collection[str] = R.FAMILIES,
        stats: Sequence[str] = DEFAULT_STATS,
        histograms: bool = True,
        histogram_bins: int = 32,
        alerts: AlertRules | bool = True,
        modules: Optional[ModuleFilter] = None,
        sentinel: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if writer is not None and log_dir is not None:
            raise ValueError(f"pass writer or log_dir, not both (got writer={writer!r}, log_dir={str(log_dir)!r})")
        if writer is not None and not all(hasattr(writer, m) for m in ("add_scalar", "add_histogram_raw", "flush")):
            raise TypeError(f"writer must be a SummaryWriter, got {type(writer).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        options = validate_options(
            every_n_steps=every_n_steps,
            schedule=schedule,
            families=families,
            stats=stats,
            histograms=histograms,
            histogram_bins=histogram_bins,
            alerts=alerts,
            modules=modules,
            sentinel=sentinel,
        )
        self.schedule, self.families, self.stats, self._bins = options.schedule, options.families, options.stats, options.bins
        self._module_filter = options.modules
        self._wants_sentinel = options.sentinel
        self._monitor = None if options.rules is None else HealthMonitor(options.rules)
        self.log_dir = None if log_dir is None else _writable_dir(log_dir)
        self._model = weakref.ref(model)
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        self._writer = writer
        self._sink: Optional[TensorBoardSink] = None
        self._state = "new"
        self._step = 0
        self._sample: Optional[_Sample] = None
        self._handles: list[Any] = []
        self._unmeasurable: set[tuple[str, str]] = set()  # (weights|gradients, name) whose statistics failed
        self._structure: Optional[StructureProbe] = None
        self._structure_written = False
        self._probe: Optional[RuntimeProbe] = None
        self._paused_gc = False
        self._probes_off = not any(family in self.families for family in PROBE_FAMILIES)
        self._offender_found = False
        self._sentinel: Optional[NonfiniteSentinel] = None
        self._optimizer_steps: Optional[list[int]] = None  # counted by a post-hook while the sentinel runs
        self._steps_seen = 0
        self._sentinel_handles: list[Any] = []
        self._sentinel_params: Optional[list[tuple[str, nn.Parameter]]] = None  # holds the parameters while it runs
        self._force_sample = False
        self._warned: set[str] = set()
        self._extra_sinks: list[Callable[[R.StepRecord], None]] = []

    # ------------------------------------------------------------------ lifecycle

    @property
    def alerts(self) -> list[Alert]:
        """Every health alert raised so far, in the order first seen (rank 0; empty elsewhere)."""
        return [] if self._monitor is None else self._monitor.alerts

    @property
    def current_step(self) -> int:
        """The index of the step in progress (closed by the next :meth:`step`)."""
        return self._step

    def start(self) -> "Inspector":
        """Open the writer, write the chart layout, and arm step 0 if it is sampled."""
        if self._state != "new":
            raise RuntimeError(f"start() called on an inspector that is {self._state}")
        if _is_writer_rank():
            writer = self._writer
            if writer is None:
                from torch.utils.tensorboard import SummaryWriter

                writer = SummaryWriter(log_dir=None if self.log_dir is None else str(self.log_dir))
            self._sink = TensorBoardSink(writer, owns_writer=self._writer is None)
        self._state = "running"
        if self._wants_sentinel and _is_writer_rank():
            self._sentinel = NonfiniteSentinel()
            if self._optimizer is not None and self._optimizer() is not None:
                self._count_optimizer_steps([self._optimizer()])
        names = [name for name, _ in self._parameters()]
        if not names:
            self._warn_once("no-params", "layerwatch: the model has no parameters; there is nothing to log")
        elif self._sink is not None and self.stats and any(family in self.families for family in R.TENSOR_FAMILIES):
            layout = R.custom_scalars_layout(names, self.stats)
            self._guard("write the chart layout", lambda: self._sink.write_layout(layout), disables_sink=True)
        self._open_sample()
        return self

    def step(self) -> None:
        """Close the current step (after ``optimizer.step()``); open the next one."""
        if self._state != "running":
            raise RuntimeError(
                f"step() called on an inspector that is {self._state}; call start() or use it as a context manager"
            )
        self._check_sentinel()
        self._close_sample()
        self._step += 1
        self._open_sample()

    def finish(self) -> None:
        """Remove every hook, flush and (if owned) close the writer. Safe to call twice."""
        if self._state == "finished":
            return
        self._drop_sample()
        self._stop_sentinel()
        if self._sink is not None:
            self._guard("flush the writer", self._sink.close, disables_sink=True)
            self._sink = None
        self._writer = None
        self._state = "finished"

    def __enter__(self) -> "Inspector":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.finish()

    def state_dict(self) -> dict[str, int]:
        """The schedule position, so a resumed run continues it."""
        return {"step": self._step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state['step'] must be an int >= 0, got {step!r}")
        self._drop_sample()
        self._step = step
        if self._state == "running":
            self._open_sample()

    # ------------------------------------------------------------------ sampling
    # A sample's life: _open_sample (step k is sampled) -> _before_update (gradients,
    # before the optimizer changes the weights) -> _after_update (weights, update ratios)
    # -> _close_sample (whatever is still missing is read, then written). step() and the
    # optimizer hooks drive it here; lightning.py drives the same methods from its hooks.

    @property
    def _sampled_step(self) -> Optional[int]:
        """The step of the open sample, or None."""
        return None if self._sample is None else self._sample.step

    def _drop_sample(self) -> None:
        """Forget the open sample without writing it."""
        self._disarm()
        self._resume_gc()
        self._sample = None

    def _advance_to(self, step: int) -> None:
        """Close the open sample and open ``step`` (for drivers that count steps themselves)."""
        self._close_sample()
        self._step = step
        self._open_sample()

    def _open_sample(self) -> None:
        self._disarm()
        sampled = self.schedule(self._step) or self._force_sample
        self._force_sample = False
        self._sample = _Sample(self._step) if sampled else None
        optimizer = self._optimizer() if self._optimizer is not None else None
        if self._sample is not None and optimizer is not None:
            self._handles = [
                optimizer.register_step_pre_hook(lambda *_: self._before_update()),
                optimizer.register_step_post_hook(lambda *_: self._after_update()),
            ]
        if self._sample is not None and self._wants_structure():
            self._guard("record the layer table", self._arm_structure)
        if self._sample is not None and not self._probes_off and _is_writer_rank():
            self._guard("arm the runtime probes", self._arm_probes)

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._take_structure()
        self._take_probes()

    def _wants_structure(self) -> bool:
        return "structure" in self.families and not self._structure_written and _is_writer_rank()

    def _arm_structure(self) -> None:
        model = self._model()
        if model is None:
            return
        if is_compiled(model):
            self._structure_written = True  # hooks would make torch.compile recompile; do not retry
            self._warn_compiled()
            return
        self._structure = StructureProbe(model, training_only=True)

    def _warn_compiled(self) -> None:
        self._warn_once(
            "compiled",
            "layerwatch: the model (or part of it) is torch.compile'd; module hooks cannot see inside a compiled "
            "graph, so the layer table and the per-module families (latency, memory, activations, nonfinite) are "
            "not recorded. Parameter families and the NaN sentinel go on. For the table call "
            "layerwatch.summarize(model._orig_mod, batch).",
        )

    def _arm_probes(self) -> None:
        model = self._model()
        if model is None:
            return
        if is_compiled(model):
            self._probes_off = True
            self._warn_compiled()
            return
        modules = select_modules(model, self._module_filter)
        if not modules:
            self._probes_off = True
            self._warn_once(
                "no-modules", f"layerwatch: modules={list(self._module_filter or ())!r} matches no module of the model; "
                "the per-module families are off",
            )
            return
        families = self.families
        if self._structure is not None:  # FlopCounterMode slows every op of this step: its times would mislead
            families = tuple(f for f in families if f != "latency")
        # The probes allocate thousands of small objects per step; each collection they would trigger
        # walks every object of the process (the model, the autograd graph). Collection waits
        # until the step is written; nothing it would free is ours to keep.
        self._paused_gc = gc.isenabled()
        gc.disable()
        self._probe = RuntimeProbe(
            modules,
            families=families,
            bins=self._bins,
            zeros="zero_frac" in self.stats,
            centered="std" in self.stats,
            parameters=[p for _, p in self._parameters()],
        )

    def _take_probes(self) -> Optional[ProbeResult]:
        """Remove the runtime probes; what they measured, when they did not fail."""
        probe, self._probe = self._probe, None
        if probe is None:
            return None
        probe.remove()
        if probe.error is None:
            try:
                return probe.result()
            except Exception as e:
                probe.error = e
        self._probes_off = True
        self._warn_once("fail:probes", f"layerwatch: a runtime probe failed: {probe.error!r}; the per-module families are off")
        return None

    def _take_structure(self) -> Optional[Summary]:
        """Remove the layer-table hooks; the table when they saw a whole forward."""
        probe, self._structure = self._structure, None
        if probe is None:
            return None
        probe.remove()
        if probe.error is not None:
            self._structure_written = True
            self._warn_once("fail:structure", f"layerwatch: could not record the layer table: {probe.error!r}; skipped")
            return None
        return probe.summary() if probe.windows else None

    def _before_update(self) -> None:
        sample = self._sample
        if sample is None or sample.grads is not None:
            return
        started = time.perf_counter()
        self._guard("read gradients", lambda: self._read_grads(sample))
        if "updates" in self.families:
            self._guard("snapshot weights for update ratios", lambda: self._snapshot(sample))
        sample.overhead_s += time.perf_counter() - started

    def _after_update(self) -> None:
        sample = self._sample
        if sample is None or sample.weights is not None:
            return
        sample.stepped = True
        started = time.perf_counter()
        self._guard("measure updates", lambda: self._measure_update(sample), when=sample.before is not None)
        self._guard("read weights", lambda: self._read_weights(sample))
        sample.overhead_s += time.perf_counter() - started

    def _close_sample(self) -> None:
        sample, self._sample = self._sample, None
        if sample is None:
            return
        started = time.perf_counter()
        structure = self._take_structure()
        probes = self._take_probes()
        self._disarm()
        self._guard("read gradients", lambda: self._read_grads(sample), when=sample.grads is None)
        self._guard("read weights", lambda: self._read_weights(sample), when=sample.weights is None)
        self._guard("write the sampled step", lambda: self._write(sample, started, structure, probes), disables_sink=True)
        self._resume_gc()

    def _resume_gc(self) -> None:
        if self._paused_gc:
            self._paused_gc = False
            gc.enable()

    def _parameters(self) -> list[tuple[str, nn.Parameter]]:
        model = self._model()
        if model is None:
            return []
        return [(name, p) for name, p in model.named_parameters() if p.numel() > 0]

    def _this_ranks_groups(
        self, pairs: Sequence[tuple[str, torch.Tensor]]
    ) -> list[tuple[Any, list[str], list[torch.Tensor]]]:
        """``(group, names, tensors)`` this rank reduces: sharded tensors (local shards) with
        their process group on every rank, then the rest by device (group None) on rank 0."""
        plain, groups = _split_sharded(pairs, self._warn_once)
        if _is_writer_rank():
            groups += [(None, names, tensors) for names, tensors in _by_device(plain)]
        return groups

    def _reduce(self, pairs: Sequence[tuple[str, torch.Tensor]], what: str) -> list[_Piece]:
        """Rows of ``what`` ("weights" or "gradients") of the named tensors this rank reduces."""
        zeros, centered = "zero_frac" in self.stats, "std" in self.stats
        pieces = []
        measurable = [(name, t) for name, t in pairs if (what, name) not in self._unmeasurable]
        for group, names, tensors in self._this_ranks_groups(measurable):
            if group is not None:  # collective: every rank must take part in step with the others
                pieces.append((names, S.reduce_sharded(tensors, group, self._bins, zeros=zeros)))
                continue
            try:
                pieces.append((names, S.reduce(tensors, self._bins, zeros=zeros, centered=centered)))
            except Exception:
                pieces.append(self._reduce_one_by_one(what, names, tensors, zeros, centered))
        return [(names, rows) for names, rows in pieces if names]

    def _reduce_one_by_one(
        self, what: str, names: list[str], tensors: list[torch.Tensor], zeros: bool, centered: bool
    ) -> _Piece:
        """After a batched reduction failed: the tensors that can be measured, and a one-time
        warning naming each that cannot (it is left out from then on)."""
        kept, rows = [], []
        for name, tensor in zip(names, tensors):
            try:
                rows.append(S.reduce([tensor], self._bins, zeros=zeros, centered=centered))
                kept.append(name)
            except Exception as e:
                self._unmeasurable.add((what, name))
                self._warn_once(
                    f"unmeasurable:{what}:{name}",
                    f"layerwatch: could not measure the {what} of {name!r} ({type(tensor).__name__}, {tensor.dtype}): "
                    f"{e!r}; they are left out from now on",
                )
        return kept, torch.cat(rows) if rows else torch.empty(0)

    def _read_grads(self, sample: _Sample) -> None:
        if "grads" not in self.families:
            return
        pairs = []
        for name, p in self._parameters():
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                self._warn_once(f"sparse:{name}", f"layerwatch: the gradient of {name!r} is sparse; it is not measured")
                continue
            pairs.append((name, p.grad))
        if not pairs and any(p.requires_grad for _, p in self._parameters()):
            self._warn_once(
                "no-grads",
                f"layerwatch: no gradients at sampled step {sample.step}; call inspector.step() after "
                "optimizer.step() and before optimizer.zero_grad(), or pass optimizer=",
            )
        sample.grads = self._reduce(pairs, "gradients")

    def _read_weights(self, sample: _Sample) -> None:
        if "weights" in self.families:
            sample.weights = self._reduce(self._parameters(), "weights")

    def _snapshot(self, sample: _Sample) -> None:
        trainable = [(name, p) for name, p in self._parameters() if p.requires_grad]
        sample.before = []
        with torch.no_grad():
            for group, names, tensors in self._this_ranks_groups(trainable):
                before = [t.detach().clone() for t in tensors]
                sample.before.append((group, names, before, _norms(before, group)))

    def _measure_update(self, sample: _Sample) -> None:
        current = dict(self._parameters())
        sample.update = []
        with torch.no_grad():
            for group, names, before, norms in sample.before:
                torch._foreach_sub_(before, [_local(current[name]).detach() for name in names])
                sample.update.append((names, torch.stack([_norms(before, group), norms])))
        sample.before = None

    def _write(
        self, sample: _Sample, started: float, structure: Optional[Summary], probes: Optional[ProbeResult]
    ) -> None:
        if not _is_writer_rank():
            return
        families = {"grads": sample.grads or [], "weights": sample.weights or [], "update": sample.update or []}
        arrays = iter(S.to_host([rows for pieces in families.values() for _, rows in pieces]))
        host = {
            family: [(names, next(arrays).reshape(len(names) if family != "update" else 2, -1)) for names, _ in pieces]
            for family, pieces in families.items()
        }
        rec = R.StepRecord(sample.step)
        for family in R.TENSOR_FAMILIES:
            for names, rows in host[family]:
                rec.add_tensor_family(family, names, rows, self.stats, self._bins)
        if host["grads"]:
            rows = np.concatenate([rows for _, rows in host["grads"]])
            nonfinite = rows[:, S.NONFINITE].sum() > 0
            rec.scalars[R.GRAD_NORM] = float("nan") if nonfinite else float(np.sqrt(rows[:, S.SUMSQ].sum()))
        for names, (deltas, norms) in host["update"]:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = np.where(deltas == 0, 0.0, deltas / norms)
            for name, ratio in zip(names, ratios.tolist()):
                rec.scalars[R.update_ratio_tag(name)] = ratio
        if structure is not None:
            rec.add_structure(structure)
            self._structure_written = True
        new_alerts = []
        if probes is not None:
            rec.add_probes(probes, self.stats, self._bins)
            if probes.offender is not None and not self._offender_found:
                self._offender_found = True  # raised before the rules, whose alert on the same layer says less
                rec.texts[R.FIRST_OFFENDER] = probes.offender.describe(rec.step)
                new_alerts += self._report(rec, "nonfinite", probes.offender.name, "first offender: " + rec.texts[R.FIRST_OFFENDER])
        if self._monitor is not None:
            new_alerts += self._check_health(rec, host, sample)
        rec.scalars[R.OVERHEAD_MS] = 1e3 * (sample.overhead_s + time.perf_counter() - started)
        if self._sink is not None:
            self._sink.write(rec)
        for extra in self._extra_sinks:
            extra(rec)
        _announce(rec.step, new_alerts)

    def _check_health(
        self, rec: R.StepRecord, host: dict[str, list[tuple[list[str], np.ndarray]]], sample: _Sample
    ) -> list[Alert]:
        """Apply the alert rules to this step; adds the count and, when it changed, the table."""
        def by_name(family: str) -> dict[str, np.ndarray]:
            return {name: row for names, rows in host[family] for name, row in zip(names, rows)}

        grads = by_name("grads") if "grads" in self.families else None
        if grads and all_zero(np.stack(list(grads.values()))).all():
            self._warn_once(
                "zero-grads",
                f"layerwatch: every gradient is zero at sampled step {rec.step}; call inspector.step() before "
                "optimizer.zero_grad(). Gradients are not judged by the alerts at such steps.",
            )
            grads = None
        skipped = self._optimizer is not None and not sample.stepped
        if grads and skipped and any(row[S.NONFINITE] for row in grads.values()):
            # GradScaler skips optimizer.step() when the scaled gradients overflow: expected, not a fault.
            rec.scalars[R.OPTIMIZER_SKIPPED] = 1.0
            logger.info("layerwatch: step %d: the optimizer skipped a step with NaN/Inf gradients", rec.step)
            self._warn_once(
                "scaler-skip",
                f"layerwatch: at step {rec.step} the optimizer skipped its step and the gradients hold NaN/Inf: "
                "a GradScaler overflow skip, not reported as a model fault (layerwatch/optimizer_skipped)",
            )
            grads = None
        new = self._monitor.observe(
            rec.step,
            weights=by_name("weights"),
            grads=grads,
            trainable=[  # a sparse gradient exists but is not measured: not "no gradient"
                name for name, p in self._parameters() if p.requires_grad and not (p.grad is not None and p.grad.is_sparse)
            ],
        )
        rec.scalars[R.ALERTS] = len(self._monitor.alerts)
        if new:
            rec.texts[R.ALERTS] = alerts_markdown(self._monitor.alerts)
        return new

    def _report(self, rec: R.StepRecord, kind: str, layer: str, message: str) -> list[Alert]:
        """An alert found outside the rules, into the record's alert table; console-only
        (returned for announcing) when alerts are off."""
        if self._monitor is None:
            return [Alert(kind, layer, rec.step, message)]
        new = self._monitor.report(kind, layer, rec.step, message)
        rec.scalars[R.ALERTS] = len(self._monitor.alerts)
        if new:
            rec.texts[R.ALERTS] = alerts_markdown(self._monitor.alerts)
        return new

    # ------------------------------------------------------------------ NaN sentinel

    def _count_optimizer_steps(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Count optimizer steps, so that a GradScaler's skipped step is not taken for a fault."""
        counter = self._optimizer_steps = [0]

        def count(*_: Any) -> None:
            counter[0] += 1

        self._sentinel_handles += [optimizer.register_step_post_hook(count) for optimizer in optimizers]

    def _check_sentinel(self) -> None:
        """Enqueue this step's check of the gradients; act on the checks that have landed."""
        sentinel = self._sentinel
        if sentinel is None:
            return
        stepped = None
        if self._optimizer_steps is not None:
            stepped = self._optimizer_steps[0] != self._steps_seen
            self._steps_seen = self._optimizer_steps[0]
        step = self._step
        self._guard("check the gradients for NaN/Inf", lambda: sentinel.check(step, self._local_grads(), stepped))
        for finding in sentinel.poll():
            if finding.stepped is False:
                logger.info("layerwatch: step %d: NaN/Inf gradients and no optimizer step (a GradScaler skip)", finding.step)
                continue
            self._guard("report NaN/Inf gradients", lambda: self._on_nonfinite(finding), disables_sink=True)
            self._stop_sentinel()
            break

    def _local_grads(self) -> list[tuple[str, torch.Tensor]]:
        if self._sentinel_params is None or self._sample is not None:  # walked again on sampled steps
            self._sentinel_params = self._parameters()
        return [(n, _local(p.grad)) for n, p in self._sentinel_params if p.grad is not None and not p.grad.is_sparse]

    def _on_nonfinite(self, finding: Finding) -> None:
        """The sentinel's first hit: the step, an alert, and every probe armed for the next step."""
        self._force_sample = True
        rec = R.StepRecord(finding.step)
        rec.scalars[R.FIRST_NONFINITE_STEP] = finding.step
        names = ", ".join(finding.tensors[:5]) + (f" and {len(finding.tensors) - 5} more" if len(finding.tensors) > 5 else "")
        overflow = "" if finding.nan else " (or finite gradients whose norm passes ~1.8e19: an explosion)"
        message = (
            f"NaN/Inf gradients at step {finding.step} (the sentinel, every step) in {names}{overflow}; "
            f"the next step is sampled with every probe armed to find the first offender"
        )
        if self._sink is not None:
            self._sink.write(rec)
        for extra in self._extra_sinks:
            extra(rec)
        logger.warning("layerwatch: %s", message)
        warnings.warn(f"layerwatch: {message}", RuntimeWarning, stacklevel=4)

    def _stop_sentinel(self) -> None:
        for handle in self._sentinel_handles:
            handle.remove()
        self._sentinel_handles = []
        self._sentinel = None
        self._sentinel_params = None

    # ------------------------------------------------------------------ failures

    def _guard(self, what: str, action: Any, when: bool = True, disables_sink: bool = False) -> None:
        """Run a probe or a write; a failure is warned once and skipped, never raised.

        A failed write stops all further writing (a full disk does not heal mid-run).
        """
        if not when:
            return
        try:
            action()
        except Exception as e:  # an inspector must never break the training run
            self._warn_once(f"fail:{what}", f"layerwatch: could not {what} at step {self._step}: {e!r}; skipped")
            if disables_sink:
                self._sink = None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _announce(step: int, alerts: list[Alert]) -> None:
    """New alerts to Python logging, one record each, and to warnings, one per step."""
    for alert in alerts:
        logger.warning("layerwatch alert at step %d: %s %s: %s", alert.step, alert.kind, alert.name, alert.message)
    if alerts:
        lines = "\n".join(f"  {a.kind} {a.name}: {a.message}" for a in alerts)
        warnings.warn(f"layerwatch: {len(alerts)} new alert(s) at step {step}:\n{lines}", RuntimeWarning, stacklevel=4)


def _by_device(pairs: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[list[str], list[torch.Tensor]]]:
    """Named tensors split by device, each group in the model's order."""
    groups: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    for name, tensor in pairs:
        names, tensors = groups.setdefault(tensor.device, ([], []))
        names.append(name)
        tensors.append(tensor)
    return list(groups.values())


def _norms(tensors: list[torch.Tensor], group: Any = None) -> torch.Tensor:
    """L2 norms; of whole sharded tensors when ``group`` is the group holding their shards."""
    norms = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(tensors)])
    if group is None:
        return norms
    import torch.distributed as dist

    squares = norms**2
    dist.all_reduce(squares, group=group)
    return squares.sqrt()


def _is_writer_rank() -> bool:
    """Rank 0 writes; every rank takes part in the reductions of sharded tensors."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(tensor, DTensor)


def _split_sharded(
    pairs: Sequence[tuple[str, torch.Tensor]], warn_once: Callable[[str, str], None]
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[Any, list[str], list[torch.Tensor]]]]:
    """Plain (or replicated) tensors, and sharded DTensors as (group, names, local shards).

    A DTensor sharded along one mesh dimension is reduced over that dimension's process
    group; replicated DTensors count as plain (their local tensor is the whole tensor).
    """
    plain: list[tuple[str, torch.Tensor]] = []
    groups: dict[Any, tuple[list[str], list[torch.Tensor]]] = {}
    for name, tensor in pairs:
        if not _is_dtensor(tensor):
            plain.append((name, tensor))
            continue
        shard_dims = [i for i, placement in enumerate(tensor.placements) if placement.is_shard()]
        if not shard_dims:
            plain.append((name, tensor.to_local()))
        elif len(shard_dims) == 1:
            names, shards = groups.setdefault(tensor.device_mesh.get_group(shard_dims[0]), ([], []))
            names.append(name)
            shards.append(tensor.to_local())
        else:
            warn_once(f"shard:{name}", f"layerwatch: {name!r} is sharded along several mesh dimensions; not measured")
    return plain, [(group, names, shards) for group, (names, shards) in groups.items()]


@dataclass(frozen=True)
class Options:
    """The checked options shared by ``Inspector`` and ``InspectCallback``."""

    schedule: Schedule
    families: tuple[str, ...]
    stats: tuple[str, ...]
    bins: int  # 0: no histograms
    rules: Optional[AlertRules]  # None: no alerts
    modules: Optional[tuple[Any, ...]]  # None: every module
    sentinel: bool


def validate_options(
    *,
    every_n_steps: Optional[int],
    schedule: Optional[ScheduleLike],
    families: Collection[str],
    stats: Sequence[str],
    histograms: bool,
    histogram_bins: int,
    alerts: AlertRules | bool,
    modules: Optional[ModuleFilter],
    sentinel: bool,
) -> Options:
    """Check every option; raises with a message that names the bad value."""
    if every_n_steps is not None and schedule is not None:
        raise ValueError(f"pass every_n_steps or schedule, not both (got {every_n_steps!r} and {schedule!r})")
    if schedule is not None:
        chosen = as_schedule(schedule)
    else:
        chosen = every_n(DEFAULT_EVERY_N_STEPS if every_n_steps is None else every_n_steps)
    if not isinstance(histograms, bool):
        raise TypeError(f"histograms must be a bool, got {histograms!r}")
    if isinstance(histogram_bins, bool) or not isinstance(histogram_bins, int) or not 2 <= histogram_bins <= S.MAX_BINS:
        raise ValueError(f"histogram_bins must be an int in [2, {S.MAX_BINS}], got {histogram_bins!r}")
    if not isinstance(alerts, (bool, AlertRules)):
        raise TypeError(f"alerts must be True, False or an AlertRules, got {alerts!r}")
    if not isinstance(sentinel, bool):
        raise TypeError(f"sentinel must be a bool, got {sentinel!r}")
    return Options(
        schedule=chosen,
        families=_check_choice("families", families, R.FAMILIES),
        stats=_check_choice("stats", stats, S.STATS),
        bins=histogram_bins if histograms else 0,
        rules=AlertRules() if alerts is True else alerts or None,
        modules=check_module_filter(modules),
        sentinel=sentinel,
    )


def _check_choice(option: str, values: Collection[str], allowed: Sequence[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise TypeError(f"{option} must be a collection of names, got the string {values!r}")
    chosen = tuple(values)
    for value in chosen:
        if value not in allowed:
            raise ValueError(f"{option}: unknown value {value!r}; choose from {', '.join(allowed)}")
    return chosen


def _writable_dir(log_dir: str | os.PathLike) -> Path:
    path = Path(log_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"log_dir {str(path)!r} is not a writable directory: {e}") from e
    return path
