"""``exploding`` / ``vanishing`` by the windows: each layer (the module that owns the parameters)
judged against its own past by the size of its values, the RMS of all its tensors' values.

Thresholds (``AlertRules``): ``window`` (the samples of a window; two are compared),
``weight_factor`` (weights: the last window's median that many times above or below the one
before) and ``grad_factor`` (gradients: grown that many times, to a level above any before; or
the layer's share of the largest layer's fallen that many times below its highest). The
absolute bounds per tensor are :class:`~layerwatch.health.rules.norm_bounds.NormBounds`'s.
Why per value, and why a share for vanishing gradients (BERT-like attention's query and key
gradients sit 10,000x below the largest layer's at initialization, healthily): docs/alerts.md,
"Layers, judged by their size per value".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from layerwatch import stats as S
from layerwatch.health.rules.rule import Broken, Rule, Seen
from layerwatch.options import AlertRules
from layerwatch.vocabulary import ROOT, Family, parent


class LayerWindows(Rule):
    """The window rules of one family (weights or gradients), per layer: the module that owns
    the parameters, judged by the size of its values (the RMS of all its tensors' values).

    Per value, tensors of very different sizes compare fairly (a norm grows with the square
    root of the count), and a small tensor does not speak for its layer: a bias crossing zero
    while its weight holds steady, or a key projection's bias in attention, whose gradient is
    zero by construction (softmax ignores what it adds to every logit of a row), sitting
    beside its weight's real gradient.

    - **Weights**, against the layer's own past: ``exploding`` / ``vanishing`` when the median
      over the last ``window`` samples is more than ``weight_factor`` times above / below the
      median over the ``window`` samples before.
    - **Gradients**: ``exploding`` when the median grew more than ``grad_factor`` times between
      windows, to a level above any window's before (gradients come back up by orders of
      magnitude from near a loss's minimum); ``vanishing`` when the layer's *share* of the
      largest layer's (at each sample) has a median more than ``grad_factor`` times below the
      highest median share of an earlier window. Healthy layers shrink together as a loss
      nears zero, so the share is judged, not the size; and against the layer's own past,
      since between layers it means little: attention's query and key gradients sit 10,000x
      below the largest layer's at initialization in BERT-like models, and that is healthy.

    A layer at exactly zero is the ``dead`` rule's.
    """

    def __init__(self, rules: AlertRules, family: Family) -> None:
        self.rules, self.family = rules, family
        self.factor = rules.weight_factor if family == Family.WEIGHTS else rules.grad_factor
        self._index: dict[str, int] = {}
        self._names: list[str] = []  # of the layers
        self._of_param = np.zeros(0, dtype=int)  # parameter index -> layer index (-1: not yet)
        size, samples = 0, 2 * rules.window
        self._rms = np.full((samples, size), np.nan)  # the last samples, oldest first
        self._share = np.full((samples, size), np.nan)
        self._steps = np.zeros((samples, size), dtype=int)
        self._filled = np.zeros(size, dtype=int)
        self._rms_peak = np.zeros(size)  # the highest window median of the RMS so far
        self._share_peak = np.zeros(size)  # the highest median share of a window before the current one
        self._peak_at = np.zeros(size, dtype=int)  # the step that window ended at

    def observe(self, seen: Seen) -> list[Broken]:
        tensors = seen.weights if self.family == Family.WEIGHTS else seen.grads
        if tensors is None:
            return []
        finite = tensors.rows.finite  # the nonfinite alert speaks for the others
        if not finite.any():
            return []
        return self._judge(seen.step, tensors.slots[finite], seen.names, tensors.rows[finite])

    def _judge(self, step: int, params: np.ndarray, names: Sequence[str], rows: S.Rows) -> list[Broken]:
        """Each rule broken at this sample, given the finite rows of the parameters ``params``
        (indices into ``names``)."""
        idx = self._layers_of(params, names)
        present = np.unique(idx)
        sumsq = np.bincount(idx, rows.sumsq, minlength=len(self._names))[present]
        count = np.bincount(idx, rows.count, minlength=len(self._names))[present]
        rms = np.sqrt(sumsq / np.maximum(count, 1))
        largest = rms.max()
        shares = rms / largest if largest > 0 else np.zeros_like(rms)
        every = len(present) == len(self._names)  # the usual case: plain slices, not index lists
        cols = slice(0, len(self._names)) if every else present
        for history, values in ((self._rms, rms), (self._share, shares), (self._steps, step)):
            history[:-1, cols] = history[1:, cols]
            history[-1, cols] = values
        self._filled[present] += 1
        w = self.rules.window
        judged = present[self._filled[present] >= 2 * w]
        if not len(judged):
            return []
        before, now = np.median(self._rms[:w, judged], axis=0), np.median(self._rms[w:, judged], axis=0)
        peak = np.fmax(self._rms_peak[judged], before)
        self._rms_peak[judged] = np.fmax(peak, now)
        if self.family == Family.WEIGHTS:
            return self._weights(judged, before, now)
        share_before, share_now = np.median(self._share[:w, judged], axis=0), np.median(self._share[w:, judged], axis=0)
        raised = share_before > self._share_peak[judged]
        self._share_peak[judged] = np.where(raised, share_before, self._share_peak[judged])
        self._peak_at[judged] = np.where(raised, self._steps[w - 1, judged], self._peak_at[judged])
        top = self._names[present[np.argmax(rms)]]
        return self._gradients(judged, before, now, peak, share_now, top, largest)

    def _weights(self, judged: np.ndarray, before: np.ndarray, now: np.ndarray) -> list[Broken]:
        found = []
        with np.errstate(divide="ignore", invalid="ignore"):
            for i in np.flatnonzero(now > self.factor * before):
                found.append(Broken("exploding", self._names[judged[i]], self._say(judged[i], "grew", now[i] / before[i], before[i], now[i]) +
                              "is the learning rate too high, or weight decay off?"))
            for i in np.flatnonzero((now * self.factor < before) & (now > 0)):
                found.append(Broken("vanishing", self._names[judged[i]], self._say(judged[i], "shrank", before[i] / now[i], before[i], now[i]) +
                              "is weight decay too strong?"))
        return found

    def _gradients(self, judged: np.ndarray, before: np.ndarray, now: np.ndarray, peak: np.ndarray, share_now: np.ndarray,
                   top: str, largest: float) -> list[Broken]:
        found, w = [], self.rules.window
        share_peak = self._share_peak[judged]
        with np.errstate(divide="ignore", invalid="ignore"):
            for i in np.flatnonzero((now > self.factor * before) & (now > peak)):
                found.append(Broken("exploding", self._names[judged[i]], self._say(judged[i], "grew", now[i] / before[i], before[i], now[i]) +
                              "above any level before: is the learning rate too high, or a layer without normalization?"))
            for i in np.flatnonzero((share_now * self.factor < share_peak) & (share_now > 0)):
                layer = self._names[judged[i]]
                found.append(Broken("vanishing", layer, (
                    f"gradient of layer {layer or ROOT} fell to {share_now[i]:.3g} of the largest layer's over the last {w} "
                    f"samples (median; RMS per value, now {now[i]:.3g}, {top or ROOT}'s {largest:.3g}): "
                    f"{share_peak[i] / share_now[i]:.3g}x below the {share_peak[i]:.3g} it had over the {w} samples to step "
                    f"{self._peak_at[judged[i]]} (AlertRules.grad_factor is {self.factor:g}). The gradient no longer "
                    "reaches it: look between it and the loss for a saturated activation (sigmoid, tanh) or a detached path")))
        return found

    def _say(self, index: int, how: str, ratio: float, before: float, now: float) -> str:
        option = "weight_factor" if self.family == Family.WEIGHTS else "grad_factor"
        what = "weights" if self.family == Family.WEIGHTS else "gradient"
        return (f"{what} of layer {self._names[index] or ROOT} {how} {ratio:.3g}x over the last {self.rules.window} samples "
                f"(median RMS per value {before:.3g} -> {now:.3g}; AlertRules.{option} is {self.factor:g}): ")

    def _layers_of(self, params: np.ndarray, names: Sequence[str]) -> np.ndarray:
        """The layer index of each parameter index (worked out once per parameter)."""
        if len(self._of_param) < len(names):
            self._of_param = np.concatenate([self._of_param, np.full(len(names) - len(self._of_param), -1)])
        for i in params[self._of_param[params] < 0]:
            self._of_param[i] = self._slot(parent(names[i]) or names[i])
        return self._of_param[params]

    def _slot(self, layer: str) -> int:
        index = self._index.get(layer)
        if index is None:
            index = self._index[layer] = len(self._names)
            self._names.append(layer)
            if index >= len(self._filled):
                extra = max(8, index)
                for name in ("_rms", "_share", "_steps"):
                    history = getattr(self, name)
                    fill = np.nan if history.dtype.kind == "f" else 0
                    setattr(self, name, np.concatenate([history, np.full((history.shape[0], extra), fill, dtype=history.dtype)], axis=1))
                for name in ("_filled", "_rms_peak", "_share_peak", "_peak_at"):
                    array = getattr(self, name)
                    setattr(self, name, np.concatenate([array, np.zeros(extra, dtype=array.dtype)]))
        return index
