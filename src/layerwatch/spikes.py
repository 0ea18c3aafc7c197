"""Loss spikes between samples: each step's loss, where the front door has it, against the steps before it.

A step's loss is a spike when it stands more than ``SpikeRule.z`` standard deviations above the
mean of the ``window`` losses before it, once ``warmup`` of them were seen (OLMo-core's and
Levanter's rule: 6 over the last 128). The detector runs on the host over floats that landed
there (:class:`LossTap`): one non-blocking copy a step on a GPU, a free read on the CPU, and
O(1) work a step (running sums, recomputed once a window so that rounding cannot drift).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from layerwatch import stats as S
from layerwatch.distributed import is_writer_rank
from layerwatch.failures import FailurePolicy
from layerwatch.sentinel import _to_host

FLAT = 1e-10  # a window whose deviation is below this (relative to its mean) is flat: no z-score (OLMo-core's floor)


@dataclass(frozen=True)
class SpikeRule:
    """When a value is a spike: more than ``z`` standard deviations above the mean of the
    ``window`` values before it, once ``warmup`` values were seen; ``capture``: the steps after
    a spike that are sampled in full."""

    z: float = 6.0
    window: int = 128
    warmup: int = 32
    capture: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.z, bool) or not isinstance(self.z, (int, float)) or not (math.isfinite(self.z) and self.z > 0):
            raise ValueError(f"SpikeRule.z must be a finite number > 0, got {self.z!r}")
        for name, least in (("window", 2), ("warmup", 2), ("capture", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SpikeRule.{name} must be an int >= {least}, got {value!r}")
        if self.warmup > self.window:
            raise ValueError(f"SpikeRule.warmup must be at most the window ({self.window}), got {self.warmup!r}")


@dataclass(frozen=True)
class Spike:
    """A value that stood ``z`` standard deviations above the trailing ``mean`` (``std``)."""

    step: int
    what: str  # "loss"
    value: float
    z: float
    mean: float
    std: float
    over: int  # the values before it that it was judged against


class SpikeDetector:
    """The rule over the values of one quantity, one per step, in step order."""

    def __init__(self, rule: SpikeRule, what: str = "loss") -> None:
        self.rule, self.what = rule, what
        self._values: deque[float] = deque(maxlen=rule.window)
        self._sum = self._squares = 0.0
        self._added = 0

    def observe(self, step: int, value: float) -> Optional[Spike]:
        """Judge ``value`` against the window before it, then add it to the window. A NaN or Inf
        is the sentinel's to find: neither judged nor kept."""
        if not math.isfinite(value):
            return None
        values, spike = self._values, None
        n = len(values)
        if n >= self.rule.warmup:
            mean = self._sum / n
            std = math.sqrt(max(self._squares / n - mean * mean, 0.0))
            if std > FLAT * max(1.0, abs(mean)) and (value - mean) / std > self.rule.z:
                spike = Spike(step, self.what, value, (value - mean) / std, mean, std, n)
        if n == values.maxlen:
            oldest = values[0]
            self._sum -= oldest
            self._squares -= oldest * oldest
        values.append(value)
        self._sum += value
        self._squares += value * value
        self._added += 1
        if self._added % values.maxlen == 0:  # running sums drift by rounding: made anew once a window
            self._sum, self._squares = math.fsum(values), math.fsum([v * v for v in values])
        return spike


class LossTap:
    """Each step's loss brought to the host without the host waiting: read at once where reads
    are free (the CPU); elsewhere a copy is started and read once it has landed (a step or more
    later on a GPU). Several losses a step (micro-batches) are averaged."""

    def __init__(self) -> None:
        # per step, in order: its losses, each a float read already or a host copy with the event that says it landed
        self._pending: deque[tuple[int, list[tuple[Any, Any]]]] = deque()

    def offer(self, step: int, loss: Any) -> None:
        """A loss of ``step`` (a tensor, averaged if it has several values, or a number)."""
        if isinstance(loss, bool) or not isinstance(loss, (int, float, torch.Tensor)):
            raise TypeError(f"loss must be a tensor or a number, got {type(loss).__name__}")
        if isinstance(loss, torch.Tensor):  # as few ops as can be: one read on the CPU, one copy elsewhere
            one = loss.numel() == 1
            if S.host_reads_free(loss.device):
                copy = (float(loss) if one else float(loss.detach().float().mean()), None)
            else:
                copy = _to_host(loss.detach().reshape(1) if one else loss.detach().float().mean().reshape(1))
        else:
            copy = (float(loss), None)
        if self._pending and self._pending[-1][0] == step:
            self._pending[-1][1].append(copy)
        else:
            self._pending.append((step, [copy]))

    def landed(self, closed: int) -> list[tuple[int, float]]:
        """The mean loss of each step up to ``closed`` whose losses have all landed, oldest first
        (a step waits for the one before it); each step once."""
        out = []
        pending = self._pending
        while pending and pending[0][0] <= closed and all(event is None or event.query() for _, event in pending[0][1]):
            step, copies = pending.popleft()
            values = [value if isinstance(value, float) else value.tolist()[0] for value, _ in copies]  # landed: no wait
            out.append((step, math.fsum(values) / len(values)))
        return out


class Spikes:
    """Each step's loss judged once it lands (:class:`LossTap`, :class:`SpikeDetector`); a
    spike is said once and asks for the next ``capture`` steps to be sampled in full
    (``ask()``: the next step that may be sampled is). A spike within ``window`` steps of the
    last capture's start is said, not captured again: a run of many spikes does not sample
    forever. With no ``rule``, nothing is judged. A failure is warned once and skipped."""

    def __init__(self, rule: Optional[SpikeRule], failures: FailurePolicy, ask: Callable[[], None]) -> None:
        self.rule, self._failures, self._ask = rule, failures, ask
        self._tap = LossTap()
        self._detector = None if rule is None else SpikeDetector(rule)
        self._capture_left = 0
        self._captured_at: Optional[int] = None
        self.found: list[Spike] = []

    def offer(self, step: int, loss: Any) -> None:
        if self._detector is not None:
            self._failures.run("take the loss", lambda: self._tap.offer(step, loss), step)

    def end_step(self, step: int) -> None:
        """``step`` closes: the losses that landed are judged; a capture under way asks for the next step."""
        if self._detector is not None:
            self._failures.run("judge the loss", lambda: self._judge(step), step)

    def _judge(self, step: int) -> None:
        for at, value in self._tap.landed(step):
            spike = self._detector.observe(at, value)
            if spike is not None:
                self._on_spike(spike, step)
        if self._capture_left:
            self._capture_left -= 1
            self._ask()

    def _on_spike(self, spike: Spike, step: int) -> None:
        self.found.append(spike)
        rule = self.rule
        say = self._failures.warn if is_writer_rank() else (lambda message: None)  # every rank asks; rank 0 says
        seen = (f"loss spike at step {spike.step}: {spike.value:.4g}, {spike.z:.1f} standard deviations above the mean of "
                f"the {spike.over} steps before it ({spike.mean:.4g} +- {spike.std:.3g})")
        if self._captured_at is not None and step - self._captured_at < rule.window:
            say(f"layerwatch: {seen}; not captured: the last capture began at step {self._captured_at}, "
                f"less than {rule.window} steps ago")
            return
        self._captured_at, self._capture_left = step, rule.capture
        then = f"steps {step + 1} to {step + rule.capture}" if rule.capture > 1 else f"step {step + 1}"
        say(f"layerwatch: {seen}; {then} are sampled in full" if rule.capture else f"layerwatch: {seen}")
