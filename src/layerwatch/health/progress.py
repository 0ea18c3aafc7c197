"""What the loss has learned, and how much of it it has given back: the context that tells
learning from failing.

A transformer that learns sharpens its attention, grows its logits and changes its update's
shape (a copy head attends to one earlier token). The literature ties these signals to
instability only where the loss fails with them:

- Wortsman et al. 2023 (small-scale proxies for large-scale instabilities): attention-logit
  growth and output-logit divergence at high learning rates, read against the final loss a
  rate reaches (its sensitivity), not as levels of their own;
- Zhai et al. 2023: attention entropy collapse comes with oscillating or diverging loss; the
  entropy also falls as a model learns, so a low entropy alone is not the fault;
- Dehghani et al. 2023 (ViT-22B): logits that grew without bound made attention one-hot and the
  loss diverged.

What differs is the loss: it falls while a model learns, and turns while it fails. So
:class:`LossProgress` follows each step's loss (the mean of the last ``loss_window`` steps):
its first mean, its lowest so far, and the share of that progress given back since
(:attr:`LossProgress.given_back`). The growth rules judge a layer only once the loss has turned
(:meth:`LossProgress.turned`), and the ``loss_rise`` rule is the loss's own: a run that gave
back ``loss_rise`` of what it had learned.

A loss is judged once it has learned: its mean fell to ``1 - learned`` of its first (a run that
has not learned a fifth of its first loss has no progress to give back). A change its own noise
explains is none: the progress, and a rise, count only beyond ``NOISE_Z`` standard errors of a
mean (the per-step losses' spread, a median over recent windows): the lowest of many noisy
means sits a few standard errors below the loss's level, and a regression on noise "learns"
only its offset. Plain host arithmetic over floats that landed there: O(1) a step, amortized.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, NamedTuple, Optional

LOSS_LAYER = "loss"  # the name a loss_rise alert is raised under
HEALTHY_GIVEN_BACK = 0.08  # the most any healthy twin of benchmarks/divergence.py gave back (docs/alerts.md)
NOISE_Z = 8  # standard errors of a window's mean a change must exceed (the lowest of ~50 noisy means: ~3 below)
STALL_WINDOWS, STALL_Z = 3, 3  # a loss with no new low for this many windows, this many standard errors above it
SPREADS = 32  # the windows' spreads the noise is the median of


class LossContext(NamedTuple):
    """What the growth rules are told of the loss at a sample (:meth:`LossProgress.context`)."""

    turned: bool  # they judge (LossProgress.turned)
    words: str  # what their alerts say of the loss
    lowest_at: Optional[int]  # the step of its lowest mean: growth is judged from there


class LossProgress:
    """Each step's loss, in step order (:meth:`observe`), as progress made and given back.

    Args:
        rules: The :class:`~layerwatch.options.AlertRules`: ``loss_window`` (steps a mean is
            taken over), ``learned`` (the share of its first mean the loss must shed before it
            is judged), ``loss_rise`` (the share of the progress given back that is an alert)
            and ``loss_turned`` (the share from which the growth rules judge).
    """

    def __init__(self, rules: Any) -> None:
        self.rules = rules
        self._window: deque[float] = deque(maxlen=rules.loss_window)
        self._sum = 0.0
        self.first: Optional[float] = None  # the first full window's mean
        self.lowest = math.inf  # the lowest mean so far
        self.lowest_at: Optional[int] = None
        self.now: Optional[float] = None  # the last mean
        self.now_at: Optional[int] = None
        self.seen = False  # a loss was ever observed
        self._raised = False  # loss_rise was raised since the loss last made new progress
        self._spreads: deque[float] = deque(maxlen=SPREADS)  # the per-step losses' variance, one per window
        self._count = 0
        self.noise = 0.0  # the standard error of a window's mean: the median spread of recent windows' losses

    @property
    def learned(self) -> bool:
        """Whether the loss has shed ``learned`` of its first mean, and more than its noise (and so is judged)."""
        return (self.first is not None and self.first > 0 and self.lowest <= (1 - self.rules.learned) * self.first
                and self.first - self.lowest > NOISE_Z * self.noise)

    def _beyond_noise(self) -> bool:
        return self.now is not None and self.now - self.lowest > NOISE_Z * self.noise

    @property
    def given_back(self) -> Optional[float]:
        """The share of its progress (first mean - lowest) the loss has given back since its
        lowest: 0 at a new low, 1 back at its first; None until it has learned."""
        if not self.learned or self.now is None:
            return None
        return (self.now - self.lowest) / (self.first - self.lowest)

    def turned(self) -> bool:
        """Whether the growth rules judge now: no loss was ever observed (nothing tells learning
        from failing: they judge as they always did), or the loss has learned and given back at
        least ``loss_turned`` of it, or it has stalled above its lowest (:meth:`stalled`)."""
        if not self.seen:
            return True
        back = self.given_back
        return back is not None and (back >= self.rules.loss_turned and self._beyond_noise() or self.stalled())

    def stalled(self) -> bool:
        """The loss has learned, made no new low for ``STALL_WINDOWS`` windows of steps, and sits
        ``STALL_Z`` standard errors above its lowest: what it gained, it has stopped gaining."""
        return (self.learned and self.now_at - self.lowest_at >= STALL_WINDOWS * self.rules.loss_window
                and self.now - self.lowest > STALL_Z * self.noise)

    def describe(self) -> str:
        """The loss's progress in words, for an alert's message."""
        back = self.given_back
        if back is None:
            return "the loss has not learned yet"
        return (f"the loss ({self.rules.loss_window}-step mean) went from {self.first:.4g} to {self.lowest:.4g} at step "
                f"{self.lowest_at} and is at {self.now:.4g}: {back:.0%} of that progress given back")

    def context(self) -> Optional[LossContext]:
        """What the growth rules are told at a sample; None when no loss was ever observed. Its
        words: the loss's progress, why the rules judge now, and where healthy runs stood."""
        if not self.seen:
            return None
        why = ("it has stalled above its lowest" if self.stalled() else
               f"it has given back {self.rules.loss_turned:.0%} (AlertRules.loss_turned)")
        words = (f"{self.describe()}, and growth is judged from its lowest on, now that {why} (the healthy twins of "
                 f"benchmarks/divergence.py gave back at most {HEALTHY_GIVEN_BACK:.0%}, their attention sharpening while "
                 "they learned)")
        return LossContext(self.turned(), words, self.lowest_at)

    def observe(self, step: int, value: float) -> Optional[str]:
        """``step``'s loss (a NaN or Inf is the sentinel's: not kept); the ``loss_rise`` alert's
        message when the loss has just given back ``loss_rise`` of its progress. Said once, and
        again only after the loss has made new progress."""
        if not math.isfinite(value):
            return None
        self.seen = True
        window = self._window
        if len(window) == window.maxlen:
            self._sum -= window[0]
        window.append(value)
        self._sum += value
        self._count += 1
        if len(window) < window.maxlen:
            return None
        if self._count % window.maxlen == 0:  # once a window: the noise, and the running sum made anew (rounding)
            self._sum = math.fsum(window)
            self._spreads.append(statistics.pvariance(window))
            self.noise = math.sqrt(statistics.median(self._spreads) / window.maxlen)
        mean = self._sum / len(window)
        self.now, self.now_at = mean, step
        if self.first is None:
            self.first = mean
        if mean < self.lowest:
            self.lowest, self.lowest_at = mean, step
            self._raised = False
        back = self.given_back
        if back is None or back < self.rules.loss_rise or self._raised or not self._beyond_noise():
            return None
        self._raised = True
        return (f"{self.describe()} (AlertRules.loss_rise is {self.rules.loss_rise:g}; the healthy runs of "
                f"benchmarks/divergence.py gave back at most {HEALTHY_GIVEN_BACK:.0%}): training is failing, or about to. "
                "A learning rate too high for this point of the run, a schedule that restarted without warm-up, bad data?")
