"""The sampled step: what it reads, when, and how its rows reach the host.

A :class:`Sample` holds what a sampled step has gathered: device rows until the step ends.
:class:`SampleReads` fills it at the protocol's three points (:meth:`~SampleReads.before_optimizer_step`:
gradients and the snapshot of the weights; :meth:`~SampleReads.after_optimizer_step`: update
ratios and weights; :meth:`~SampleReads.rest`: whatever the step has not read yet) and takes its
rows to the host in one transfer per device (:meth:`~SampleReads.host_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
from torch import nn

from layerwatch.vocabulary import Family
from layerwatch import stats as S
from layerwatch.distributed.sharding import FAILED_NORM, is_writer_rank, local_tensors
from layerwatch.guards.failures import FailurePolicy
from layerwatch.measure.optimizer_state import AdamState, WIDTH, failed as adam_failed
from layerwatch.options import Options
from layerwatch.measure.params import ParameterFamilies, Piece, Snapshot
from layerwatch.probes import ProbeResult
from layerwatch.measure.zero import Zero


@dataclass
class Sample:
    """What a sampled step has gathered so far: device tensors until ``end_step``."""

    step: int
    params: list[tuple[str, nn.Parameter]]
    steps_before: Optional[int]  # the optimizers' step count when it began (None: not counted)
    overhead_s: float = 0.0
    before_calls: int = 0  # before_optimizer_step calls that read something
    after_calls: int = 0
    grads: list[Piece] = field(default_factory=list)
    weights: list[Piece] = field(default_factory=list)
    update: list[Piece] = field(default_factory=list)
    update_estimate: list[Piece] = field(default_factory=list)  # from strided samples: the snapshot did not fit
    adam: list[Piece] = field(default_factory=list)  # Adam's state after the step (optimizer_state.py)
    adam_spikes: list[Piece] = field(default_factory=list)  # its gradient spikes, read before the step
    expert_grads: list[Piece] = field(default_factory=list)  # the fused expert parameters' slices <param>[e] (measure/experts.py)
    expert_weights: list[Piece] = field(default_factory=list)
    expert_update: list[Piece] = field(default_factory=list)  # exact snapshots' only
    optimizers: list[Any] = field(default_factory=list)  # those whose gradients were read before their step
    adam_read: set[int] = field(default_factory=set)  # id() of the parameters whose Adam state was read
    grads_read: set[int] = field(default_factory=set)  # id() of the parameters read so far
    weights_read: set[int] = field(default_factory=set)
    snapshots: list[tuple[Optional[int], Snapshot]] = field(default_factory=list)  # (id of the optimizer, ...)
    replay: Optional[ProbeResult] = None  # what the probes saw on the step's batch run again (faults/replay.py)

    def unread(self, read: set[int], optimizer: Any,
               keep: Optional[list[tuple[str, nn.Parameter]]] = None) -> list[tuple[str, nn.Parameter]]:
        """The parameters (of ``optimizer``, or all; of ``keep`` only, when given) not read yet
        into ``read``; now marked read."""
        mine = None if optimizer is None else {id(p) for group in optimizer.param_groups for p in group["params"]}
        out = [(n, p) for n, p in (self.params if keep is None else keep)
               if id(p) not in read and (mine is None or id(p) in mine)]
        read.update([id(p) for _, p in out])
        return out

    def stepped(self, steps_now: Optional[int]) -> Optional[bool]:
        """Whether the optimizer stepped during the sample: counted when the optimizers are
        tracked (``steps_now``: their step count now); else False when ``before_optimizer_step``
        came and ``after_optimizer_step`` did not (an optimizer's post-hook never fires for a
        skipped step); else unknown."""
        if self.steps_before is not None and steps_now is not None:
            return steps_now != self.steps_before
        return None if self.before_calls == 0 else self.after_calls >= self.before_calls

    def spent(self, seconds: float) -> None:
        """layerwatch took ``seconds`` of this sampled step (its ``overhead_ms``)."""
        self.overhead_s += seconds

    def replayed(self, result: Any, seconds: float) -> None:
        """The step was run again with every probe armed (a fault's replay): what the probes saw, and its time."""
        self.replay = result
        self.overhead_s += seconds

    def trained(self) -> bool:
        """Whether the step computed gradients (so the model ran)."""
        return any(p.grad is not None for _, p in self.params)

    def trainable(self) -> list[str]:
        """The parameters with ``requires_grad``, as the health rules count them."""
        return [  # a sparse gradient exists but is not measured: not "no gradient"
            name for name, p in self.params if p.requires_grad and not (p.grad is not None and p.grad.is_sparse)
        ]


UPDATES = (S.UPDATE_ROWS, S.ESTIMATED_UPDATE_ROWS, S.EXPERT_UPDATE_ROWS)  # the families of two rows of columns
NORMS = (S.EXPERT_GRAD_ROWS, S.EXPERT_WEIGHT_ROWS)  # the families of one row of columns: the experts' slices' norms
OPTIONAL = (*WIDTH, S.EXPERT_GRAD_ROWS, S.EXPERT_WEIGHT_ROWS, S.EXPERT_UPDATE_ROWS)  # a family in HostRows only where it has pieces


def _rows_of(family: str, names: list[str]) -> int:
    """How many rows a family's piece of ``names`` has on the host: its columns' (updates: ``‖Δw‖``
    and ``‖w‖``; the experts' slices: their norms), or one per tensor."""
    return 2 if family in UPDATES else 1 if family in NORMS else len(names)


class SampleReads:
    """Reads the parameter families (:class:`~layerwatch.measure.params.ParameterFamilies`) into a
    :class:`Sample`, each parameter once, at the first point of the step where it is final."""

    def __init__(self, options: Options, failures: FailurePolicy, params: ParameterFamilies) -> None:
        self.families = options.families
        self.failures = failures
        self.params = params
        self.adam = AdamState(params.groups, failures.say_once)

    def before_optimizer_step(self, sample: Sample, optimizer: Any, zero: Optional[Zero]) -> None:
        """``optimizer``'s gradients (every parameter's when None) are final: read those not read
        yet, and snapshot their weights for the update ratios. Under DeepSpeed ZeRO, the
        parameters of the group its optimizer steps now (its client holds flat partitions)."""
        params = (sample.unread(sample.grads_read, optimizer) if zero is None
                  else sample.unread(sample.grads_read, None, keep=zero.stepping_params(sample.params)))
        if not params:
            return
        sample.before_calls += 1
        self._gradients(sample, params)
        if Family.OPTIMIZER in self.families and zero is None and optimizer is not None:
            sample.optimizers.append(optimizer)
            self.failures.run("read the optimizer's state", lambda: sample.adam_spikes.extend(
                self.adam.before_step(optimizer, params)), sample.step)
        if Family.UPDATES in self.families:
            key = None if optimizer is None else id(optimizer)
            self.failures.run("snapshot weights for update ratios", lambda: self._snapshot(sample, params, key), sample.step)

    def after_optimizer_step(self, sample: Sample, optimizer: Any) -> None:
        """``optimizer`` (every optimizer when None) has stepped: the updates of its parameters,
        and their weights."""
        key = None if optimizer is None else id(optimizer)
        mine = [key is None or owner in (key, None) for owner, _ in sample.snapshots]
        snapshots = [snap for (_, snap), taken in zip(sample.snapshots, mine) if taken]
        sample.snapshots = [entry for entry, taken in zip(sample.snapshots, mine) if not taken]
        params = sample.unread(sample.weights_read, optimizer)
        if snapshots or params:
            sample.after_calls += 1
        for snapshot in snapshots:
            self.failures.run("measure updates", lambda: self._updates(sample, snapshot), sample.step)
        self._weights(sample, params)
        self._optimizer_state(sample, [optimizer] if optimizer is not None else sample.optimizers)

    def rest(self, sample: Sample, tracked: Sequence[Any] = ()) -> None:
        """The step ends: what it has not read yet (a door that leaves the optimizer's points out).
        ``tracked``: the optimizers the door named, for a sample made after their step (a fault's)."""
        self._gradients(sample, sample.unread(sample.grads_read, None))
        for _, snapshot in sample.snapshots:
            self.failures.run("measure updates", lambda: self._updates(sample, snapshot), sample.step)
        self._weights(sample, sample.unread(sample.weights_read, None))
        optimizers = sample.optimizers or [optimizer for optimizer in tracked if optimizer is not None]
        self._optimizer_state(sample, optimizers)
        if Family.OPTIMIZER in self.families and not optimizers and self.params.zero is None and is_writer_rank():
            self.failures.say_once("no-optimizer", (
                "layerwatch: Adam's state (adam_update_rms, adam_eps_frac, adam_spike_frac) is read where the "
                "optimizer is known: pass optimizer= to the Inspector"))

    def _optimizer_state(self, sample: Sample, optimizers: list[Any]) -> None:
        """Adam's state after the step, of the parameters of ``optimizers`` not read yet."""
        if Family.OPTIMIZER not in self.families:
            return
        if self.params.zero is not None:
            if is_writer_rank():
                self.failures.say_once("zero-optimizer", "layerwatch: a DeepSpeed ZeRO optimizer keeps its state in "
                                       "flat partitions; the optimizer-state signals (adam_*) are not read")
            return
        for optimizer in optimizers:
            params = sample.unread(sample.adam_read, optimizer)
            if params:
                self.failures.run("read the optimizer's state", lambda: sample.adam.extend(
                    self.adam.after_step(optimizer, params)), sample.step)

    def _gradients(self, sample: Sample, params: list[tuple[str, nn.Parameter]]) -> None:
        if params and Family.GRADS in self.families:
            read = self.failures.run("read gradients", lambda: self.params.gradients(params, sample.step), sample.step)
            if read is not None:
                sample.grads.extend(read[0])
                sample.expert_grads.extend(read[1])

    def _weights(self, sample: Sample, params: list[tuple[str, nn.Parameter]]) -> None:
        if params and Family.WEIGHTS in self.families:
            read = self.failures.run("read weights", lambda: self.params.weights(params), sample.step)
            if read is not None:
                sample.weights.extend(read[0])
                sample.expert_weights.extend(read[1])

    def _snapshot(self, sample: Sample, params: list[tuple[str, nn.Parameter]], key: Optional[int]) -> None:
        if not sample.snapshots:  # the step's first: what a memory_budget given as a share is a share of
            tensors = local_tensors([p for _, p in sample.params])
            self.params.start_snapshots(sum([t.numel() * t.element_size() for t in tensors]))
        sample.snapshots.append((key, self.params.snapshot(params, sample.step, f"snapshot{len(sample.snapshots)}.")))

    def _updates(self, sample: Sample, snapshot: Snapshot) -> None:
        pieces, experts = self.params.updates(snapshot, sample.params, weight_norms=Family.WEIGHTS not in self.families)
        (sample.update_estimate if snapshot.estimated else sample.update).extend(pieces)
        sample.expert_update.extend(experts)

    def host_rows(self, sample: Sample) -> S.HostRows:
        """The families' rows, on the host in one transfer per device, less the rows a rank
        could not help measure."""
        families = {S.GRAD_ROWS: sample.grads, S.WEIGHT_ROWS: sample.weights, S.UPDATE_ROWS: sample.update,
                    S.ESTIMATED_UPDATE_ROWS: sample.update_estimate, S.ADAM_ROWS: sample.adam,
                    S.ADAM_SPIKE_ROWS: sample.adam_spikes, S.EXPERT_GRAD_ROWS: sample.expert_grads,
                    S.EXPERT_WEIGHT_ROWS: sample.expert_weights, S.EXPERT_UPDATE_ROWS: sample.expert_update}
        arrays = iter(S.to_host([rows for pieces in families.values() for _, rows in pieces]))
        return {
            family: [self._measured(family, names, next(arrays).reshape(_rows_of(family, names), -1), sample.step)
                     for names, _ in pieces]
            for family, pieces in families.items() if pieces or family not in OPTIONAL
        }

    def _measured(self, family: str, names: list[str], rows: np.ndarray, step: int) -> tuple[list[str], np.ndarray]:
        """``names`` and their rows (update pieces: their two rows of columns) less the sharded
        tensors a rank could not help measure, or snapshot (said once)."""
        columns = family in UPDATES or family in NORMS  # rows of columns, a tensor's values in column i
        failed = rows[0] == FAILED_NORM if columns else adam_failed(rows) if family in WIDTH else S.Rows(rows).failed
        if not failed.any():
            return names, rows
        left_out = [name for name, bad in zip(names, failed) if bad]
        which = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        what = ("snapshot its shards of {} for the update ratios; their update ratios are left out" if family in UPDATES
                else f"measure its shards of {{}} ({family}); they are left out")
        self.failures.warn_once(f"failed-rows:{family}", f"layerwatch: a rank could not {what.format(which)} of step {step}")
        kept = [name for name, bad in zip(names, failed) if not bad]
        return kept, rows[:, ~failed] if columns else rows[~failed]
