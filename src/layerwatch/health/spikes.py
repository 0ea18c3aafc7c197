"""Loss spikes between samples: each step's loss and global gradient norm, where the front door
has them, against the steps before it.

A step's value is a spike when it stands more than ``SpikeRule.z`` standard deviations above
the mean of the ``window`` values before it, once ``warmup`` of them were seen (OLMo-core's and
Levanter's rule: 6 over the last 128), on the logarithm of the values while they are positive
(:class:`SpikeDetector`). The detector runs on the host over floats that landed
there (:class:`ValueTap`): one non-blocking copy a step on a GPU, a free read on the CPU, and
O(1) work a step (running sums, recomputed once a window so that rounding cannot drift).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from layerwatch.health.findings import Findings
from layerwatch.health.alert import Alert
from layerwatch.health.check import HealthCheck
from layerwatch import stats as S
from layerwatch.distributed.agreement import Decision
from layerwatch.distributed.sharding import is_dtensor, is_writer_rank, local
from layerwatch.guards.failures import FailurePolicy
from layerwatch.health.growth import LayerGrowth
from layerwatch.options import SpikeRule
from layerwatch.probes import ProbeResult
from layerwatch.health.progress import LOSS_LAYER, LossProgress
from layerwatch.vocabulary import GRAD_NORM_LEAD_UP, LOSS

MOST_UNVOTED = 1024  # losses kept for the ranks' vote: a run whose vote stalls does not keep them all

FLAT = 1e-10  # a window whose deviation is below this (relative to its mean) is flat: no z-score (OLMo-core's floor)
SIGNALS = {"loss": ("loss", LOSS), "grad_norm": ("gradient norm", GRAD_NORM_LEAD_UP)}  # what is judged: its words, its lead-up's tag


@dataclass(frozen=True)
class Spike:
    """A value that stood ``z`` standard deviations above the trailing mean of the ``lead_up``
    (the steps judged before it and their values, oldest first), on the ``scale`` it was judged
    on: ``"log"``, the logarithm of the values (``mean`` is then their geometric mean, ``std``
    the deviation of their logarithm), or ``"linear"``, the values themselves."""

    step: int
    what: str  # "loss" or "grad_norm" (SIGNALS)
    value: float
    z: float
    mean: float
    std: float
    lead_up: tuple[tuple[int, float], ...] = ()
    scale: str = "log"

    def event(self) -> dict[str, Any]:
        """What ``layerwatch/events/spikes`` says of it (the tab's and the report's)."""
        return {"step": self.step, "what": self.what, "value": self.value, "z": self.z, "mean": self.mean,
                "std": self.std, "scale": self.scale, "over": len(self.lead_up), "text": self.describe()}

    def describe(self) -> str:
        n, what = len(self.lead_up), SIGNALS[self.what][0]
        if self.scale == "log":
            return (f"{what} spike at step {self.step}: {self.value:.4g}, {_times(self.value / self.mean)} the geometric "
                    f"mean of the {n} steps before it ({self.mean:.4g}), {_z(self.z)} standard deviations of their "
                    f"logarithm above it")
        return (f"{what} spike at step {self.step}: {self.value:.4g}, {_z(self.z)} standard deviations above the mean "
                f"of the {n} steps before it ({self.mean:.4g} +- {self.std:.3g})")


class SpikeDetector:
    """The rule over the values of one quantity, one per step, in step order, on the logarithm
    of the values while none is negative (a spike is a jump by a factor: a loss near zero that
    varies by factors of ten from batch to batch, as a classifier's that fits its data, is not
    spiking), and on the values themselves from the first one that is."""

    def __init__(self, rule: SpikeRule, what: str = "loss") -> None:
        self.rule, self.what = rule, what
        self._window: deque[tuple[int, float]] = deque(maxlen=rule.window)  # (step, value), oldest first
        self.log = True  # judged on the logarithm: no value <= 0 came yet
        self._sum = self._squares = 0.0  # of the window's values on the scale judged
        self._added = 0

    def observe(self, step: int, value: float) -> Optional[Spike]:
        """Judge ``value`` against the window before it, then add it to the window. A NaN or Inf
        is the sentinel's to find: neither judged nor kept; nor is a loss of exactly 0 while the
        logarithm is judged (a classifier sure of every answer: no spike, and no logarithm)."""
        if not math.isfinite(value):
            return None
        if self.log and value <= 0:
            if value == 0:
                return None
            self.log = False
            self._resum()
        window, spike = self._window, None
        t = math.log(value) if self.log else value
        n = len(window)
        if n >= self.rule.warmup:
            mean = self._sum / n
            std = math.sqrt(max(self._squares / n - mean * mean, 0.0))
            if std > FLAT * max(1.0, abs(mean)) and (t - mean) / std > self.rule.z:
                spike = Spike(step, self.what, value, (t - mean) / std, math.exp(mean) if self.log else mean, std,
                              tuple(window), "log" if self.log else "linear")
        if n == window.maxlen:
            oldest = window[0][1]
            oldest = math.log(oldest) if self.log else oldest
            self._sum -= oldest
            self._squares -= oldest * oldest
        window.append((step, value))
        self._sum += t
        self._squares += t * t
        self._added += 1
        if self._added % window.maxlen == 0:  # running sums drift by rounding: made anew once a window
            self._resum()
        return spike

    def _resum(self) -> None:
        values = [math.log(v) if self.log else v for _, v in self._window]
        self._sum, self._squares = math.fsum(values), math.fsum(v * v for v in values)


class Unreadable(Exception):
    """A value on a device whose values the host cannot read without waiting for it (neither the
    CPU's nor a CUDA device's, whose copy to the host waits for nothing)."""


class ValueTap:
    """Each step's value of one quantity (its loss, its gradient norm) brought to the host without
    the host waiting: read at once where reads are free (the CPU); on a CUDA device a copy is
    started and read once it has landed (a step or more later). Several values a step are
    combined (:meth:`landed`); a value offered for a step already given out (a second
    optimizer's, after the first one's step was judged) is not taken."""

    def __init__(self, what: str = "loss", norms: bool = False) -> None:
        self.what, self.norms = what, norms  # what: in words, for what it says; norms: see landed()
        # offered, not given out by landed(), per step in order: [step, its values (floats read, or host copies)],
        # read once its copies landed
        self.pending = S.Landings()
        self._given = -1  # the last step given out by landed()
        self.offered = False  # a value was ever offered

    def offer(self, step: int, value: Any) -> None:
        """A value of ``step`` (a tensor, averaged if it has several values, or a number).

        Raises:
            TypeError: ``value`` is neither.
            Unreadable: a tensor on a device other than the CPU or a CUDA device.
        """
        if step <= self._given:
            return
        event = None
        # a DTensor: a norm of sharded gradients (torch's clip_grad_norm_ under FSDP2: partial on each rank)
        if type(value) is not torch.Tensor and is_dtensor(value):
            if not all(placement.is_replicate() for placement in value.placements):
                raise Unreadable(f"a {self.what} that is a DTensor placed {tuple(value.placements)} is not judged: "
                                 "reading it is a collective")
            value = local(value)
        if isinstance(value, torch.Tensor):  # as few ops as can be: one read on the CPU, one copy elsewhere
            one = value.numel() == 1
            if S.host_reads_free(value.device):
                # the CPU's: a read of memory, no device to wait for (item(): no autograd warning)
                read = value.item() if one else value.detach().float().mean().item()
            elif value.device.type not in ("cuda", "cpu"):  # (the CPU: a test taking the accelerator's way)
                raise Unreadable(f"a {self.what} on {value.device} is not judged: its host copy would wait for the device")
            else:
                read, event = S.to_host_nonblocking(value.detach().reshape(1) if one else value.detach().float().mean().reshape(1))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            read = value
        else:
            raise TypeError(f"a {self.what} must be a tensor or a number, got {type(value).__name__}")
        pending = self.pending
        self.offered = True
        if not pending.entries or pending.entries[-1][0][0] != step:
            pending.add([step, []])
        (_, values), events = pending.entries[-1]
        values.append(read)
        if not isinstance(read, (int, float)):  # a host copy: read once landed (its event None: landed already)
            events.append(event)

    def landed(self, closed: float, wait: bool = False) -> list[tuple[int, float, int]]:
        """Each step up to ``closed`` whose values have all landed, oldest first (a step waits for
        the one before it), each once: its value (several: their mean, or with ``norms`` the
        norm of them all, as of several optimizers' disjoint parameters) and which of them was
        the largest (its index). ``wait``: the host waits for them to land (at the end of a run)."""
        out = []
        for step, values in self.pending.landed(wait, through=closed):
            if not all(isinstance(v, (int, float)) for v in values):  # host copies among them
                values = [float(v) if isinstance(v, (int, float)) else v.tolist()[0] for v in values]  # landed: no wait
            self._given = step
            if len(values) == 1:
                out.append((step, float(values[0]), 0))
            else:
                value = math.sqrt(math.fsum(v * v for v in values)) if self.norms else math.fsum(values) / len(values)
                out.append((step, value, max(range(len(values)), key=values.__getitem__)))
        return out


class _Signal:
    """One quantity judged step by step: its tap, its detector, the values it judged last (the
    lead-up of the other quantity's spikes), the last step of its lead-up written (a tag's
    steps only grow)."""

    def __init__(self, rule: SpikeRule, what: str) -> None:
        self.what, self.written_to = what, -1
        self.tap = ValueTap(SIGNALS[what][0], norms=what == "grad_norm")
        self.detector = SpikeDetector(rule, what)
        self.recent: deque[tuple[int, float]] = deque(maxlen=2 * rule.window)

    def lead_up(self, spike: Spike, kept: tuple[tuple[int, float], ...] = ()) -> list[tuple[int, float]]:
        """This quantity's values of the ``window`` steps up to ``spike``'s, as judged: the
        spike's own as it was; another's from ``kept`` (what this one had judged when the spike
        was found) and what it judged since (its values land later, or through the vote)."""
        if spike.what == self.what:
            return [*spike.lead_up, (spike.step, spike.value)]
        since, values = spike.step - self.detector.rule.window, dict(kept)
        values.update(self.recent)
        return sorted((at, value) for at, value in values.items() if since <= at <= spike.step)


class Spikes:
    """Each step's loss and global gradient norm judged once they land (:class:`ValueTap`,
    :class:`SpikeDetector`), each against its own steps before it.

    A spike is said once and asks for the next ``capture`` steps to be sampled in full
    (``ask()``: the next step that may be sampled is). Where it is found in its own step (its
    value read at once, on the CPU: before the optimizer step when the door hands it over
    before then, else at the step's end), that step is sampled too (:meth:`judge` says so). A
    spike within ``window`` steps of the last capture's start is said, not captured again: a run
    of many spikes does not sample forever. At the next sample written, :meth:`explain` ranks
    the layers that grew most. With no ``rule``, nothing is judged. A failure is warned once and
    skipped.

    Each loss judged also goes to ``progress`` (the health rules', :class:`~layerwatch.health.progress.LossProgress`):
    a loss that gave back ``AlertRules.loss_rise`` of what it had learned is a ``loss_rise``
    alert, said at the next sample written, and captured as a spike is."""

    def __init__(self, rule: Optional[SpikeRule], failures: FailurePolicy, ask: Callable[[], None],
                 write_findings: Optional[Callable[[int, Findings, list[Alert]], None]] = None,
                 progress: Optional[LossProgress] = None) -> None:
        self.rule, self._failures, self._ask, self._progress = rule, failures, ask, progress
        self._write_findings = write_findings  # Output.write_findings: the spikes found since the last sample, at the end
        self._risen: list[Alert] = []  # loss_rise alerts found since the last sample written
        self._signals = {} if rule is None else {what: _Signal(rule, what) for what in SIGNALS}  # none: off
        self._capture_left = 0
        self._captured_at: Optional[int] = None
        self._captured_for: Optional[int] = None  # the spiking step of the last capture
        self._growth = LayerGrowth()
        self._unwritten: list[tuple[Spike, dict]] = []  # found since the last sample written, the others' recent values then
        self.found: list[Spike] = []
        self.now = True  # a spike's own step may be sampled when it is found (not where the ranks vote on samples)
        self._voted: Optional[deque[tuple[int, float]]] = None  # the landed losses the ranks vote on, oldest first

    def start(self, together: bool, writer: bool) -> None:
        """Where the run's ranks sample together (they vote on each step), each rank's losses
        ride on the vote and every rank judges the largest of them, step by step, the same
        values (:meth:`unvoted`, :meth:`on_voted`): the same spikes and captures on every rank;
        each judges its own gradient norm, the global one and so the same on every rank (a
        capture any rank asks for is every rank's through the vote). Where they do not, rank 0
        alone samples and writes, and alone judges its own values."""
        self.now = not together
        if together:
            self._voted = deque(maxlen=MOST_UNVOTED)
        elif not writer:
            self._signals = {}

    def offer(self, step: int, value: Any, what: str = "loss") -> None:
        """``step``'s loss, or (``what="grad_norm"``) its global gradient norm.

        Raises:
            ValueError: ``what`` is neither (a front door's mistake, not the training run's).
        """
        if what not in SIGNALS:
            raise ValueError(f"what must be one of {sorted(SIGNALS)}, got {what!r}")
        signal = self._signals.get(what)
        if signal is not None:
            try:
                signal.tap.offer(step, value)
            except Unreadable as e:
                self._failures.warn(f"layerwatch: {e}; {SIGNALS[what][0]} spikes are not looked for in this run")
                del self._signals[what]
            except Exception as e:  # an inspector must never break the training run
                self._failures.failed(f"take the {SIGNALS[what][0]}", e, step)

    @property
    def has_losses(self) -> bool:
        """Whether this rank was given a loss: a pipeline stage but the last never is, and stands aside in the vote."""
        return "loss" in self._signals and self._signals["loss"].tap.offered

    def judge(self, step: int, closing: bool) -> Optional[int]:
        """Judge the values that have landed, before ``step``'s optimizer step or (``closing``)
        at its end; a capture under way asks for the next step at the end. Returns, when
        ``step`` itself spiked and is captured now (``now``: not where the ranks sample
        together), which of its micro-batches had the largest loss; else None."""
        now, losses = None, ()
        try:
            for what, signal in self._signals.items():
                landed = signal.tap.landed(step) if signal.tap.pending.entries else ()
                if not landed:
                    continue
                if what == "loss":
                    losses = landed
                    if self._voted is not None:  # judged when the ranks have voted on them
                        self._voted.extend((at, value) for at, value, _ in landed)
                        continue
                if self._observe(signal, landed, step) and now is None:  # the micro-batch with the largest loss
                    now = next((micro for at, _, micro in losses if at == step), 0)
            if closing and self._capture_left and self._voted is None:  # the ranks' votes ask in on_voted
                self._capture_left -= 1
                self._ask()
        except Exception as e:  # an inspector must never break the training run
            self._failures.failed("judge the loss and the gradient norm", e, step)
        return now

    def close(self, step: int, health: Optional[HealthCheck] = None) -> None:
        """The run ends at ``step``: the values not judged yet are (waiting for those still on
        their way: training is over), and rank 0 writes the spikes no sample explained, at
        ``step``, unranked, their alerts raised with ``health``'s. The losses the ranks vote on
        are not: they no longer vote."""
        try:
            for what, signal in self._signals.items():
                if what != "loss" or self._voted is None:
                    self._observe(signal, signal.tap.landed(math.inf, wait=True), step, ended=True)
            if not (self._unwritten or self._risen) or self._write_findings is None:
                return
            findings = self.explain(step, {})
            alerts = findings.alerts if health is None else [
                new for a in findings.alerts for new in health.monitor.report(a.kind, a.name, a.step, a.message)]
            self._write_findings(step, findings, alerts)
        except Exception as e:  # an inspector must never break the training run
            self._failures.failed("write the last loss spikes", e, step)

    def unvoted(self) -> Optional[tuple[int, float]]:
        """This rank's oldest loss the ranks have not voted on (a NaN or Inf as -inf: the others' count)."""
        if not self._voted:
            return None
        at, value = self._voted[0]
        return at, value if math.isfinite(value) else -math.inf

    def on_voted(self, decision: Decision, step: int) -> None:
        """The vote of ``step``'s decision: the ranks' largest loss of a step, judged on every rank
        alike; or the step the ranks' losses go on from (a rank lacked those before it). A capture
        under way asks for the next step (in the ballot that goes out next)."""
        voted, signal = self._voted, self._signals.get("loss")
        if voted is None:
            return
        try:
            if signal is not None and decision.loss is not None:
                at, value = decision.loss
                while voted and voted[0][0] <= at:
                    voted.popleft()
                self._observe(signal, [(at, value, 0)], step)
            elif decision.losses_from is not None:
                while voted and voted[0][0] < decision.losses_from:
                    voted.popleft()
            if self._capture_left:  # one ballot a step: the next steps, one by one
                self._capture_left -= 1
                self._ask()
        except Exception as e:  # an inspector must never break the training run
            self._failures.failed("judge the loss", e, step)

    def _observe(self, signal: _Signal, landed: list[tuple[int, float, int]], step: int, ended: bool = False) -> bool:
        """Judge ``signal``'s ``landed`` values (step, value, largest micro-batch) at ``step``: each spike
        said and captured (:meth:`_on_spike`). Whether ``step`` itself spiked and is captured now."""
        now = False
        for at, value, _ in landed:
            if signal.what == "loss" and self._progress is not None:
                self._rise(at, value, ended)
            spike = signal.detector.observe(at, value)
            if math.isfinite(value) and (value != 0 or not signal.detector.log):  # as the detector kept it
                signal.recent.append((at, value))
            now = spike is not None and self._on_spike(spike, step, ended) and at == step or now
        return now

    def _rise(self, at: int, value: float, ended: bool) -> None:
        """``at``'s loss to the loss's progress: a rise is said at the next sample written (rank 0) and,
        unless the run has ended, its next ``capture`` steps are sampled in full."""
        message = self._progress.observe(at, value)
        if message is None:
            return
        if is_writer_rank():
            self._risen.append(Alert("loss_rise", LOSS_LAYER, at, message))
        if not ended:
            self._capture_left = max(self._capture_left, self.rule.capture)

    def _on_spike(self, spike: Spike, step: int, ended: bool = False) -> bool:
        """Say ``spike`` (found at ``step``; ``ended``: as the run ends) and capture what follows;
        True: ``step`` itself is captured now."""
        self.found.append(spike)
        if is_writer_rank():  # rank 0 writes it
            self._unwritten.append((spike, {what: tuple(other.recent) for what, other in self._signals.items()
                                            if what != spike.what}))
        rule = self.rule
        say = self._failures.warn if is_writer_rank() else (lambda message: None)  # every rank asks; rank 0 says
        if ended:
            say(f"layerwatch: {spike.describe()}; found as the run ended: not captured")
            return False
        now = self.now and spike.step == step
        if self._captured_for == spike.step:  # the other quantity spiked at the same step
            other = next(SIGNALS[what][0] for what in SIGNALS if what != spike.what)
            say(f"layerwatch: {spike.describe()}; captured with the {other} spike of its step")
            return now and self._captured_at == step
        if self._captured_at is not None and step - self._captured_at < rule.window:
            say(f"layerwatch: {spike.describe()}; not captured: the last capture began at step {self._captured_at}, "
                f"less than {rule.window} steps ago")
            return False
        self._captured_at, self._captured_for, self._capture_left = step, spike.step, rule.capture
        steps = [f"step {step}"] if now else []
        if rule.capture:
            steps.append(f"steps {step + 1} to {step + rule.capture}" if rule.capture > 1 else f"step {step + 1}")
        plural = len(steps) > 1 or rule.capture > 1
        say(f"layerwatch: {spike.describe()}" + (f"; {' and '.join(steps)} {'are' if plural else 'is'} sampled in full"
                                                 if steps else ""))
        return now

    def explain(self, step: int, rows: S.HostRows, probes: Optional[ProbeResult] = None, replayed: bool = False) -> Findings:
        """At a sample written (rank 0): the spikes found since the last one, as findings: their
        ``spike`` alerts and events, each with the layers ranked by growth since they were last
        sampled (:class:`~layerwatch.health.growth.LayerGrowth`: ``origin``, the modules whose output grew most beyond
        their input's, where ``probes`` saw the forward; ``layers``, whose gradient or update
        grew most), and the lead-ups to write (the window of values before each spike and its
        own, of the loss and of the gradient norm; the steps not written before). ``replayed``:
        ``probes`` come from the step's batch run again. An alert is a step's: it says each
        spike of that step, and names the first of ``origin``, else of ``layers``."""
        spikes, self._unwritten = self._unwritten, []
        risen, self._risen = self._risen, []
        try:
            ranked, origin = self._growth.observe(rows, probes, rank=bool(spikes))
        except Exception as e:  # an inspector must never break the training run: the spikes are said unranked
            self._failures.failed("rank the layers that grew at a spike", e, step)
            ranked, origin = [], []
        lead_ups: dict[str, list[tuple[int, float]]] = {}
        for spike, kept in spikes:  # each quantity's steps up to the spike, the one that spiked as it was judged
            for what, signal in self._signals.items():
                for at, value in signal.lead_up(spike, kept.get(what, ())):
                    if at > signal.written_to:
                        lead_ups.setdefault(SIGNALS[what][1], []).append((at, value))
                        signal.written_to = at
        began = f"; began at {origin[0].layer} (its output grew {_times(origin[0].factor)} more than its input)" if origin else ""
        grew = ", ".join(f"{g.layer} ({g.what} {_times(g.factor)})" for g in ranked)
        said = began + (f"; grew most: {grew}" if grew else "")
        layer = (origin or ranked)[0].layer if origin or ranked else None

        def message(described: str, at: int) -> str:
            return described + said + (f" (measured at step {step})" if said and step != at else "")

        events = [{**spike.event(), "layer": layer or spike.what, "sampled_at": step,
                   "replayed": replayed and spike.step == step, "origin": [g.as_dict() for g in origin],
                   "layers": [g.as_dict() for g in ranked], "message": message(spike.describe(), spike.step)}
                  for spike, _ in spikes]
        same_step: dict[int, list[Spike]] = {}  # the loss's and the gradient norm's spikes of one step: one alert
        for spike, _ in spikes:
            same_step.setdefault(spike.step, []).append(spike)
        alerts = risen + [Alert("spike", layer or found[0].what, at, message("; ".join(s.describe() for s in found), at))
                          for at, found in same_step.items()]
        return Findings(alerts=alerts, spikes=events, history=lead_ups)


def _z(z: float) -> str:
    return f"{z:.1f}" if z < 1e4 else f"{z:.2e}"


def _times(factor: float) -> str:
    return f"x{factor:.3g}" if factor < 100 else f"x{factor:,.0f}" if factor < 1e6 else f"x{factor:.2e}"
