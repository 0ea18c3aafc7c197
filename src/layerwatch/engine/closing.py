"""The close of a sampled step, after its last optimizer step: the probes taken, the rest read,
a pipeline's stages gathered (every rank), and on the writing rank the step's rows brought to the
host, what they say concluded, its cost taken, its record written."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Union

from layerwatch.distributed.sharding import is_writer_rank
from layerwatch.engine.stages import StagePart
from layerwatch.engine.output import Output
from layerwatch.engine.placement import Placement
from layerwatch.engine.rerun import Rerun
from layerwatch.engine.sampling import Sampling
from layerwatch.faults.faults import Faults
from layerwatch.faults.sentinel import StepCounter
from layerwatch.guards.failures import FailurePolicy
from layerwatch.guards.hooks import CollectorClock
from layerwatch.health.check import HealthCheck
from layerwatch.health.findings import unjudged
from layerwatch.health.spikes import Spikes
from layerwatch.measure.reads import Sample, SampleReads
from layerwatch.options import Options
from layerwatch.probes import ProbeResult, StepProbes
from layerwatch.table.summary import Summary
from layerwatch.vocabulary import Family


@dataclass
class Closing:
    """The engine's parts a sampled step's close asks, given once when the engine is made."""

    options: Options
    failures: FailurePolicy
    probes: StepProbes
    rerun: Rerun
    reads: SampleReads
    faults: Faults
    spikes: Spikes
    health: Optional[HealthCheck]
    sampling: Sampling
    output: Output
    collector: CollectorClock
    counter: StepCounter
    written: int = 0  # sampled steps written

    def close(self, sample: Sample, placement: Placement) -> None:
        """Every rank: take the probes, read the rest, gather the stages (collective); the writer writes."""
        started = time.perf_counter()
        sample.spent(self.probes.hook_seconds + self.rerun.close(sample.step))
        stages = placement.stages
        sync = None if stages is not None else self.sampling.sync  # a stage's probes combine nothing with other ranks'
        structure, probes = self.probes.take(sync, sample.step, sample.trained(), placement.layout.flattened)
        probes = sample.replay or probes
        self.reads.rest(sample, self.faults.tracked())
        gathered: Union[StagePart, None, bool] = None  # every stage's measurements, on the writer; False: not gathered
        if stages is not None:  # every rank, whatever it measured: collective
            gathered = self.failures.run("gather the pipeline stages' measurements", lambda: stages.gather(
                sample.step, lambda: self.reads.host_rows(sample), probes, sample.trainable), sample.step, otherwise=False)
            probes = gathered.probes if isinstance(gathered, StagePart) else None
        if is_writer_rank() and gathered is not False:
            self.failures.run("write the sampled step", lambda: self._write(sample, started, structure, probes,
                                                                            gathered or None), sample.step)
        self.collector.remove()
        self.sampling.close_sampled(sample.step)

    def _write(self, sample: Sample, started: float, structure: Optional[Summary], probes: Optional[ProbeResult],
               stages: Optional[StagePart] = None) -> None:
        """Rank 0: the step's rows to the host, what they and the probes say, then its record to the sinks, built and
        written after the step's cost is taken (both count in the next sample's: :meth:`Sampling.cost`). ``stages``: every
        stage's rows, gathered already."""
        rows = self.reads.host_rows(sample) if stages is None else stages.rows
        stepped = sample.stepped(self.counter.count)
        offender_alerts = self.faults.offender_alerts(sample.step, probes, stepped)
        spiked = self.spikes.explain(sample.step, rows, probes, replayed=sample.replay is not None)
        findings = unjudged(offender_alerts, spiked) if self.health is None else self.health.judge(
            sample.step, rows, Family.GRADS in self.options.families,
            sample.trainable() if stages is None else stages.trainable, stepped, probes, offender_alerts, spiked)
        cost_s, interval = self.sampling.cost(sample.step, sample.overhead_s, started, self.collector.seconds, findings.alerts)
        self.written += 1
        self.sampling.wrote(self.output.write_step(sample.step, rows, probes, structure, findings, self.options,
                                                   cost_s, interval, all_grads=stages is None or stages.complete))
