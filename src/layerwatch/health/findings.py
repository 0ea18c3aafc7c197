"""What was concluded about one sampled step, complete when its maker returns it: the health
rules' alerts, the first offender, the spikes explained. Read by ``record.build``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from layerwatch.probes.result import Offender


@dataclass
class Findings:
    """What was concluded about one sampled step: by the health rules (``alerts.HealthCheck``)
    and the probes' first offender. Plain data, read by :func:`build`."""

    alerts: list = field(default_factory=list)  # the alerts first seen at this step
    alert_count: Optional[int] = None  # every alert raised so far; None where no rules run
    alert_table: Optional[str] = None  # the table of them all, when some are new
    optimizer_skipped: bool = False  # the optimizer skipped the step, its gradients non-finite
    offender: Optional[Offender] = None  # the first offender, named at this step
    spikes: list = field(default_factory=list)  # the loss spikes found since the last sample (spikes.Spike.event, explained)
    history: dict = field(default_factory=dict)  # tag -> [(step, value)] of earlier steps: a spike's lead-up
