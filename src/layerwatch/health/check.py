"""Health alerts: rules over the sampled records that say what is wrong, once per layer and kind.

``HealthMonitor.observe`` is given each sampled step's per-parameter rows (``stats`` columns,
on the host) and returns the alerts first seen at that step; ``HealthCheck.judge`` makes them a
step's findings. The rules, each a module of :mod:`layerwatch.health.rules`, with their
thresholds in :class:`AlertRules`:

- ``dead``: every gradient of a layer is exactly zero, or a trainable parameter's weights
  are all zero, for ``dead_samples`` samples in a row (a frozen zero bias is not dead).
- ``stuck``: a trainable parameter that has a non-zero gradient but has never changed between
  samples, for ``stuck_samples`` samples in a row; or that gets no gradient at all for as long.
- ``exploding`` / ``vanishing``: judged per layer, by its size per value (the RMS of all its
  tensors' values; :mod:`~layerwatch.health.rules.layer_windows`). Weights: the median over the last ``window``
  samples more than ``weight_factor`` times above / below the median over the ``window``
  samples before. Gradients: ``exploding`` when the median grew more than ``grad_factor``
  times between windows, to a level above any seen before; ``vanishing`` when the layer's
  share of the largest layer's fell more than ``grad_factor`` times below the highest share
  it had in an earlier window. Either: a tensor's norm outside its absolute bounds.
- ``nonfinite``: NaN or Inf in a parameter's weights or gradients.
- ``sign_like`` / ``eps_bound``: Adam's own state, per layer (its tensors' coordinates pooled;
  :mod:`~layerwatch.health.rules.update_shape`). ``sign_like``: the normalized update RMS's median over the last
  ``window`` samples at least ``sign_like_rms`` and ``sign_like_factor`` times the lowest
  median of a window before it; ``eps_bound``: more than ``eps_bound_frac`` of the coordinates
  with a gradient have ``√v̂ < 10ε``, at ``window`` samples in a row.
- ``attention_logits`` / ``entropy_collapse``: per attention module, its heads folded
  (:mod:`~layerwatch.health.rules.probe_trends`). The largest logit at ``attention_logit_level`` or above; or, from a
  tenth of that level, its window median ``attention_logit_growth`` times the lowest of a window
  before. The lowest head entropy's window median below ``entropy_collapse`` times the highest of
  a window before.
- ``logit_drift``: the output head's mean ``log Z`` (logsumexp of a token's logits), its window
  median more than ``logit_drift`` nats from its first window's (:mod:`~layerwatch.health.rules.probe_trends`).
- ``outlier_growth``: a module output's ``max|h| / RMS(h)``, its window median ``outlier_growth``
  times the lowest of a window before; or its per-channel kurtosis ``kurtosis_growth`` times
  (:mod:`~layerwatch.health.rules.probe_trends`).
- ``router_collapse`` / ``dead_expert`` / ``router_z_growth`` / ``routing_entropy_collapse``: each
  Mixture-of-Experts router against its own past (the probes' ``moe`` family). Its busiest
  expert's concentration (from its fair share ``k/E`` toward every token, 0 to 1), the median of
  the last 3 samples, at least ``router_collapse`` and ``router_collapse_growth`` times its lowest
  window before; an expert with no token at ``window`` samples in a row; its mean log Z's window
  median ``router_z_growth`` nats above its lowest before; its routing entropy's window median
  below ``router_entropy_collapse`` of its highest before.
- ``loss_rise``: the loss gave back ``loss_rise`` of what it had learned
  (:class:`~layerwatch.health.progress.LossProgress`, judged at every step by the spike check).

The growth rules (``GROWTH_KINDS``) judge only once the loss has turned (given back
``loss_turned`` of its progress): attention that sharpens, logits that grow and updates that
change shape come with healthy learning too (benchmarks/divergence.py). The absolute level of
``attention_logits`` is judged at every sample.

Alerts are named by layer (the module that owns the parameter), so a layer's weight and
bias raise one alert between them.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from layerwatch import stats as S
from layerwatch.guards.failures import FailurePolicy
from layerwatch.health.alert import EVENT_KINDS, GROWTH_KINDS, Alert, alerts_markdown
from layerwatch.health.findings import Findings, OffenderAlerts, unjudged
from layerwatch.health.progress import LossContext, LossProgress
from layerwatch.health.rules import Rule, Seen, Tensors, every_rule
from layerwatch.options import AlertRules
from layerwatch.vocabulary import parent

logger = logging.getLogger("layerwatch")


class HealthMonitor:
    """Applies :class:`AlertRules` to the sampled steps; raises each (kind, layer) once.

    Each parameter has a slot (its index, in the order first seen), by which the rules keep their
    state in arrays, so a step costs a few vectorized passes whatever the number of tensors;
    Python loops only over the parameters that break a rule.
    """

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self.alerts: list[Alert] = []
        self._raised: set[tuple] = set()
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self._layers: list[str] = []  # each slot's module (its parameter's parent), made once
        self._rules: list[Rule] = every_rule(rules)
        self._lowest_at: Optional[int] = None  # the step of the loss's lowest mean at the last sample

    def observe(
        self,
        step: int,
        *,
        weights: dict[str, np.ndarray],
        grads: Optional[dict[str, np.ndarray]],
        trainable: Sequence[str],
        adam: Sequence[tuple[list[str], np.ndarray]] = (),
        probes: Any = None,
        loss: Optional[LossContext] = None,
    ) -> list[Alert]:
        """The alerts first seen at ``step``.

        Args:
            weights: Parameter name -> its weights' stats row (empty when weights are not read).
            grads: Parameter name -> its gradient's stats row, for parameters that have one;
                None when gradients are not read.
            trainable: Names of the parameters with ``requires_grad``.
            adam: Adam's state after the step, as pieces of names and rows
                (:mod:`~layerwatch.measure.optimizer_state`).
            probes: The step's :class:`~layerwatch.probes.ProbeResult` (its attention, output
                logits, activation rows and kurtosis), or None.
            loss: What the growth rules are told of the loss
                (:meth:`~layerwatch.health.progress.LossProgress.context`): whether it has turned (they
                judge only then), its progress in words (said in their alerts), the step of its
                lowest mean (at each new lowest, growth is judged afresh from there); None: no
                loss is known, and they judge at every sample, against the whole run.
        """
        seen_weights = self._tensors(weights)
        seen_grads = None if grads is None else self._tensors(grads)
        trainable_slots = self._slots(trainable)
        turned, meanwhile, lowest_at = loss or (True, "", None)
        if lowest_at != self._lowest_at:  # learning: what grew while the loss fell is not judged
            self._lowest_at = lowest_at
            for rule in self._rules:
                rule.restart()
        seen = Seen(step, self._names, self._layers, seen_weights, seen_grads, trainable_slots, adam, probes, turned)
        new: list[Alert] = []
        for rule in self._rules:
            for kind, layer, message in rule.observe(seen):
                grown = kind in GROWTH_KINDS and meanwhile
                self._raise(new, kind, layer, step, f"{message}; meanwhile {meanwhile}" if grown else message)
        return new

    def report(self, kind: str, layer: str, step: int, message: str) -> list[Alert]:
        """Raise an alert found outside the rules (the runtime probes); [] when already raised."""
        new: list[Alert] = []
        self._raise(new, kind, layer, step, message)
        return new

    def _slots(self, names: Iterable[str]) -> np.ndarray:
        """The parameters' slots (new ones get the next)."""
        names = list(names)
        indices = list(map(self._index.get, names))
        if None in indices:
            for i, name in enumerate(names):
                if indices[i] is None:
                    index = self._index.get(name)  # a name twice in ``names``: its first place
                    if index is None:
                        index = self._index[name] = len(self._names)
                        self._names.append(name)
                        self._layers.append(parent(name))
                    indices[i] = index
        return np.array(indices, dtype=int)

    def _tensors(self, rows: dict[str, np.ndarray]) -> Tensors:
        """The slots and stacked rows of ``rows`` (name -> row)."""
        return Tensors(self._slots(rows), S.Rows.stack(list(rows.values())))

    def _raise(self, new: list[Alert], kind: str, layer: str, step: int, message: str) -> None:
        key = (kind, layer, step) if kind in EVENT_KINDS else (kind, layer)
        if key in self._raised:
            return
        self._raised.add(key)
        alert = Alert(kind, layer, step, message)
        self.alerts.append(alert)
        new.append(alert)


class HealthCheck:
    """The rules applied to each sampled step's rows: what they find, as
    :class:`~layerwatch.health.findings.Findings` for the record, whole (never written into later)."""

    def __init__(self, rules: AlertRules, failures: FailurePolicy) -> None:
        self.monitor = HealthMonitor(rules)
        self.failures = failures
        self.progress = LossProgress(rules)  # each step's loss, observed by the spike check (Spikes)

    def judge(
        self,
        step: int,
        rows: S.HostRows,
        grads_read: bool,
        trainable: Sequence[str],
        stepped: Optional[bool],
        probes: Any = None,
        offender_alerts: OffenderAlerts = ((), None),
        spiked: Optional[Findings] = None,
    ) -> Findings:
        """The findings of ``step``, whole: the alerts found outside the rules raised first (the first
        offender's, ``offender_alerts`` from :meth:`~layerwatch.faults.faults.Faults.offender_alerts`,
        then the ``spiked`` findings' of :meth:`~layerwatch.health.spikes.Spikes.explain`), then the
        rules' on the weights' and gradients' rows, Adam's state and the ``probes``' result
        (:class:`~layerwatch.probes.ProbeResult`: attention, output logits); with the offender, the
        spikes and their lead-ups. ``stepped`` is False when the optimizer skipped the step (None:
        not known)."""
        def by_name(family: str) -> dict[str, np.ndarray]:
            return {name: row for names, family_rows in rows.get(family, ()) for name, row in zip(names, family_rows)}

        found = unjudged(offender_alerts, spiked)
        new: list[Alert] = []
        for alert in found.alerts:
            new += self.monitor.report(alert.kind, alert.name, alert.step, alert.message)  # a spike's step is its own
        grads = by_name(S.GRAD_ROWS) if grads_read else None
        if grads and S.Rows.stack(list(grads.values())).all_zero.all():
            self.failures.warn_once(
                "zero-grads",
                f"layerwatch: every gradient is zero at sampled step {step}; call inspector.step() before "
                "optimizer.zero_grad(). Gradients are not judged by the alerts at such steps.",
            )
            grads = None
        skipped = bool(grads) and stepped is False and bool(S.Rows.stack(list(grads.values())).nonfinite.any())
        if skipped:
            # GradScaler skips optimizer.step() when the scaled gradients overflow: expected, not a fault.
            logger.info("layerwatch: step %d: the optimizer skipped a step with NaN/Inf gradients", step)
            self.failures.warn_once(
                "scaler-skip",
                f"layerwatch: at step {step} the optimizer skipped its step and the gradients hold NaN/Inf: "
                "a GradScaler overflow skip, not reported as a model fault (layerwatch/optimizer_skipped)",
            )
            grads = None
        new += self.monitor.observe(step, weights=by_name(S.WEIGHT_ROWS), grads=grads, trainable=trainable,
                                    adam=rows.get(S.ADAM_ROWS, ()), probes=probes, loss=self.progress.context())
        return replace(found, alerts=new, alert_count=len(self.monitor.alerts),
                       alert_table=alerts_markdown(self.monitor.alerts) if new else None, optimizer_skipped=skipped)

    def say_if_too_short(self, samples: int) -> None:
        """At the end of a run: say when it had too few samples for the window rules to judge."""
        window = self.monitor.rules.window
        if 0 < samples < 2 * window:
            self.failures.warn_once(
                "too-short",
                f"layerwatch: this run was sampled {samples} time(s); the exploding and vanishing rules compare the "
                f"median norm of the last {window} samples with the {window} before, so they need {2 * window} samples "
                "and could not fire (AlertRules' absolute norm bounds still apply). For a short run, sample more "
                "often (every_n_steps) or pass alerts=AlertRules(window=...).",
            )
