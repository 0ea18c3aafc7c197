"""What was concluded about one sampled step, complete when its maker returns it: the health
rules' alerts, the first offender, the spikes explained. Made by ``check.HealthCheck.judge``, or
by :func:`unjudged` where no rules run; read by ``record.build``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from layerwatch.probes.result import Offender


@dataclass
class Findings:
    """What was concluded about one sampled step: by the health rules (``alerts.HealthCheck``),
    the probes' first offender and the spike check. Plain data, read by ``record.build``."""

    alerts: list = field(default_factory=list)  # the alerts first seen at this step
    alert_count: Optional[int] = None  # every alert raised so far; None where no rules run
    alert_table: Optional[str] = None  # the table of them all, when some are new
    optimizer_skipped: bool = False  # the optimizer skipped the step, its gradients non-finite
    offender: Optional[Offender] = None  # the first offender, named at this step
    spikes: list = field(default_factory=list)  # the loss spikes found since the last sample (spikes.Spike.event, explained)
    history: dict = field(default_factory=dict)  # tag -> [(step, value)] of earlier steps: a spike's lead-up


OffenderAlerts = tuple[Sequence, Optional[Offender]]  # Faults.offender_alerts: its alerts (once a run), the offender named


def unjudged(offender_alerts: OffenderAlerts = ((), None), spiked: Optional[Findings] = None) -> Findings:
    """The findings of a sampled step as they came, no health rules run: the first offender's
    alerts and the spikes' (``spiked``: :meth:`~layerwatch.health.spikes.Spikes.explain`'s, the
    spikes found since the last sample with their lead-ups), the offender, the spikes."""
    found, named = offender_alerts
    spiked = spiked or Findings()
    return Findings(alerts=[*found, *spiked.alerts], offender=named, spikes=spiked.spikes, history=spiked.history)
