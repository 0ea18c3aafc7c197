"""Where the records go: the TensorBoard sink, the sinks added, and Python's warnings and logging.

:class:`Output` is rank 0's: it opens (or wraps) the writer, hands each
:class:`~layerwatch.sinks.record.StepRecord` to every sink, and says new alerts once. A failed write
stops all further writing (a full disk does not heal mid-run); a failing added sink is warned
about and skipped.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional

from torch import nn
from layerwatch.sinks import record as R
from layerwatch.health.findings import Findings
from layerwatch import stats as S
from layerwatch.health.alert import Alert
from layerwatch.guards.failures import FailurePolicy
from layerwatch.guards.hooks import Attachments
from layerwatch.options import Options
from layerwatch.engine.placement import Placement
from layerwatch.probes import ProbeResult, probe_name, select_modules
from layerwatch.sinks.tensorboard import TensorBoardSink
from layerwatch.table.summary import Summary

logger = logging.getLogger("layerwatch")


class Output:
    """Rank 0's sinks. The TensorBoard sink lives in ``attached`` (it is closed with the hooks
    when the engine is collected without a ``finish``)."""

    def __init__(self, attached: Attachments, failures: FailurePolicy, writer: Any = None) -> None:
        if writer is not None and not all(hasattr(writer, m) for m in ("add_scalar", "add_histogram_raw", "flush")):
            raise TypeError(f"writer must be a SummaryWriter, got {type(writer).__name__}")
        self._attached = attached
        self.failures = failures
        self._writer = writer  # the caller's, or None: one of our own
        self._extra: list[Callable[[R.StepRecord], None]] = []

    @property
    def sink(self) -> Optional[TensorBoardSink]:
        return self._attached.sink

    def open(self, log_dir: Optional[os.PathLike]) -> None:
        """Write into the caller's writer (flushed, never closed), or else a ``SummaryWriter`` of
        our own on ``log_dir`` (its default ``runs/...`` when None), closed at :meth:`close`."""
        if self._writer is not None:
            self._attached.use_sink(TensorBoardSink(self._writer, owns_writer=False))
            return

        def open_writer() -> None:
            from torch.utils.tensorboard import SummaryWriter

            own = SummaryWriter(log_dir=None if log_dir is None else str(log_dir))
            self._attached.use_sink(TensorBoardSink(own, owns_writer=True))

        self.failures.run("open the TensorBoard writer (nothing is written; training goes on)", open_writer, 0)

    def add(self, sink: Callable[[R.StepRecord], None]) -> None:
        """Also hand every record written to ``sink``."""
        self._extra.append(sink)

    def emit(self, rec: R.StepRecord, step: int) -> None:
        """``rec`` to every sink, at the open ``step`` (which a failure's warning names)."""
        self.write_with(lambda sink: sink.write(rec), "write the sampled step", step)
        for extra in self._extra:
            self.failures.run("hand the step to an added sink", lambda: extra(rec), rec.step)

    def write_with(self, action: Callable[[TensorBoardSink], None], what: str, step: int) -> None:
        """A write; a failed one stops all further writing (a full disk does not heal mid-run)."""
        sink = self.sink
        if sink is not None and not self.failures.run(what, lambda: action(sink) or True, step, otherwise=False):
            self._attached.use_sink(None)

    def write_layout(self, model: nn.Module, placement: Placement, options: Options, step: int) -> None:
        """The charts' layout (TensorBoard's custom scalars) of the model's parameters and
        modules (of every pipeline stage's)."""
        if self.sink is None:
            return
        names = [name for name, _ in placement.layout.parameters(model)]
        modules = [probe_name(name) for name, _ in select_modules(model, options.modules)]
        if placement.stages is not None:
            names, modules = placement.stages.params, placement.stages.modules
        layout = R.custom_scalars_layout(names, modules, options.families, options.stats)
        if layout:
            self.write_with(lambda sink: sink.write_layout(layout), "write the chart layout", step)

    def write_step(self, step: int, rows: S.HostRows, probes: Optional[ProbeResult], structure: Optional[Summary],
                   findings: Findings, options: Options, cost_s: float, interval: Optional[int], all_grads: bool) -> float:
        """A sampled step's record (:func:`~layerwatch.sinks.record.build`) to every sink, and its new
        alerts said. Returns the seconds that took."""
        writing = time.perf_counter()
        rec = R.build(step, rows, probes, structure, findings, stats=options.stats, bins=options.bins,
                      overhead_ms=1e3 * cost_s, sample_interval=interval, all_grads=all_grads)
        self.emit(rec, step)
        seconds = time.perf_counter() - writing
        self.announce(rec.step, findings.alerts)
        return seconds

    def close(self, step: int) -> None:
        """Flush the writer, and close it when it is our own."""
        if self.sink is not None:
            self.write_with(lambda sink: sink.close(), "flush the writer", step)
            self._attached.use_sink(None)
        self._writer = None

    def write_fault(self, fault_step: int, step: int) -> None:
        """The first step whose gradients were non-finite (found between samples), to every sink at once."""
        self.emit(R.build(fault_step, first_nonfinite_step=fault_step), step)

    def write_findings(self, step: int, findings: Findings, alerts: list[Alert]) -> None:
        """What was found between samples (the last loss spikes) to every sink, and its new ``alerts`` said."""
        self.emit(R.build(step, findings=findings), step)
        self.announce(step, alerts)

    def announce(self, step: int, alerts: list[Alert]) -> None:
        """New alerts to Python logging, one record each, and to warnings, one per step."""
        for alert in alerts:
            logger.warning("layerwatch alert at step %d: %s %s: %s", alert.step, alert.kind, alert.name, alert.message)
        if alerts:
            lines = "\n".join(f"  {a.kind} {a.name}: {a.message}" for a in alerts)
            self.failures.warn(f"layerwatch: {len(alerts)} new alert(s) at step {step}:\n{lines}")
