"""Health alerts: rules over the sampled records that say what is wrong, once per layer and kind.

``HealthMonitor.observe`` is given each sampled step's per-parameter rows (``stats`` columns,
on the host) and returns the alerts first seen at that step. The rules, with their
thresholds in :class:`AlertRules`:

- ``dead``: every gradient of a layer is exactly zero, or a trainable parameter's weights
  are all zero, for ``dead_samples`` samples in a row (a frozen zero bias is not dead).
- ``stuck``: a trainable parameter that has a non-zero gradient but has never changed between
  samples, for ``stuck_samples`` samples in a row; or that gets no gradient at all for as long.
- ``exploding`` / ``vanishing``: judged per layer, by its size per value (the RMS of all its
  tensors' values; :class:`LayerWindows`). Weights: the median over the last ``window``
  samples more than ``weight_factor`` times above / below the median over the ``window``
  samples before. Gradients: ``exploding`` when the median grew more than ``grad_factor``
  times between windows, to a level above any seen before; ``vanishing`` when the layer's
  share of the largest layer's fell more than ``grad_factor`` times below the highest share
  it had in an earlier window. Either: a tensor's norm outside its absolute bounds.
- ``nonfinite``: NaN or Inf in a parameter's weights or gradients.
- ``sign_like`` / ``eps_bound``: Adam's own state, per layer (its tensors' coordinates pooled;
  :class:`UpdateShape`). ``sign_like``: the normalized update RMS's median over the last
  ``window`` samples at least ``sign_like_rms`` and ``sign_like_factor`` times the lowest
  median of a window before it; ``eps_bound``: more than ``eps_bound_frac`` of the coordinates
  with a gradient have ``√v̂ < 10ε``, at ``window`` samples in a row.
- ``attention_logits`` / ``entropy_collapse``: per attention module, its heads folded
  (:class:`ProbeTrends`). The largest logit at ``attention_logit_level`` or above; or, from a
  tenth of that level, its window median ``attention_logit_growth`` times the lowest of a window
  before. The lowest head entropy's window median below ``entropy_collapse`` times the highest of
  a window before.
- ``logit_drift``: the output head's mean ``log Z`` (logsumexp of a token's logits), its window
  median more than ``logit_drift`` nats from its first window's (:class:`ProbeTrends`).
- ``outlier_growth``: a module output's ``max|h| / RMS(h)``, its window median ``outlier_growth``
  times the lowest of a window before; or its per-channel kurtosis ``kurtosis_growth`` times
  (:class:`ProbeTrends`).
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
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from layerwatch.health.alert import EVENT_KINDS, GROWTH_KINDS, Alert, alerts_markdown
from layerwatch.health.findings import Findings
from layerwatch import stats as S
from layerwatch.guards.failures import FailurePolicy
from layerwatch.options import AlertRules
from layerwatch.measure.optimizer_state import EPS_BOUND, SEEN, UPDATE_SUMSQ, VALUES
from layerwatch.health.progress import LossContext, LossProgress
from layerwatch.vocabulary import ROOT, parent

logger = logging.getLogger("layerwatch")


class HealthMonitor:
    """Applies :class:`AlertRules` to the sampled steps; raises each (kind, layer) once.

    State is kept in arrays indexed by parameter (in the order first seen), so a step costs
    a few vectorized passes whatever the number of tensors; Python loops only over the
    parameters that break a rule.
    """

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self.alerts: list[Alert] = []
        self._raised: set[tuple] = set()
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self._layers: list[str] = []  # each slot's module (its parameter's parent), made once
        size = 0
        self._zero_grads = np.zeros(size, dtype=int)
        self._zero_weights = np.zeros(size, dtype=int)
        self._unchanged = np.zeros(size, dtype=int)
        self._no_grad = np.zeros(size, dtype=int)
        self._last_weights = np.full((size, S.FINGERPRINT_WIDTH), np.nan)
        self._moved = np.zeros(size, dtype=bool)  # the weights changed between two samples, ever
        self._windows = {"weights": LayerWindows(rules, "weights"), "grads": LayerWindows(rules, "grads")}
        self._update_shape = UpdateShape(rules)
        self._probe_trends = ProbeTrends(rules)
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
        new: list[Alert] = []
        w_idx, w_rows = self._stack(weights)
        g_idx, g_rows = self._stack(grads or {})
        t_idx = self._slots(trainable)
        self._nonfinite(step, (("gradients", g_idx, g_rows), ("weights", w_idx, w_rows)), new)
        self._norms(step, "weights", w_idx, w_rows, new)
        self._norms(step, "grads", g_idx, g_rows, new)
        self._dead(step, w_idx, w_rows, g_idx if grads is not None else None, g_rows, t_idx, new)
        self._stuck(step, w_idx, w_rows, None if grads is None else (g_idx, g_rows), t_idx, new)
        turned, meanwhile, lowest_at = loss or (True, "", None)
        if lowest_at != self._lowest_at:  # learning: what grew while the loss fell is not judged
            self._lowest_at = lowest_at
            self._update_shape.restart()
            self._probe_trends.restart()
        found = []
        if adam:
            names = [name for names, _ in adam for name in names]
            found += self._update_shape.observe(names, np.concatenate([rows for _, rows in adam]), turned)
        found += self._probe_trends.observe(probes, turned) if probes is not None else []
        for kind, layer, message in found:
            grown = kind in GROWTH_KINDS and meanwhile
            self._raise_for(new, kind, layer, step, f"{message}; meanwhile {meanwhile}" if grown else message)
        return new

    # ------------------------------------------------------------------ rules

    def _nonfinite(self, step: int, families: tuple, new: list[Alert]) -> None:
        found: dict[str, list[str]] = {}  # layer -> what holds NaN/Inf, gradients first
        first_param: dict[str, str] = {}
        for what, idx, rows in families:
            counts = rows.nonfinite
            for i in np.flatnonzero(counts > 0):
                name = self._names[idx[i]]
                found.setdefault(parent(name), []).append(f"{what} of {name} ({int(counts[i]):,})")
                first_param.setdefault(parent(name), name)
        for layer, parts in found.items():
            more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
            self._raise(new, "nonfinite", first_param[layer], step, "NaN/Inf values in " + ", ".join(parts[:3]) + more)

    def _norms(self, step: int, family: str, idx: np.ndarray, rows: np.ndarray, new: list[Alert]) -> None:
        """The absolute bounds, per tensor; the window rules, per layer (:class:`LayerWindows`)."""
        finite = rows.finite  # the nonfinite alert speaks for the others
        idx, rows = idx[finite], rows[finite]
        if not len(idx):
            return
        norms = rows.norm
        low, high = self.rules.weight_norm_bounds if family == "weights" else self.rules.grad_norm_bounds
        label, option = ("weight", "weight_norm_bounds") if family == "weights" else ("gradient", "grad_norm_bounds")
        for i in np.flatnonzero(norms > high) if high is not None else ():
            name = self._names[idx[i]]
            self._raise(new, "exploding", name, step, f"{label} norm of {name} is {norms[i]:.3g}, above the bound {high:g} "
                        f"(AlertRules.{option})")
        for i in np.flatnonzero(norms < low) if low is not None else ():
            name = self._names[idx[i]]
            self._raise(new, "vanishing", name, step, f"{label} norm of {name} is {norms[i]:.3g}, below the bound {low:g} "
                        f"(AlertRules.{option})")
        for kind, layer, message in self._windows[family].observe(step, idx, self._names, rows):
            self._raise_for(new, kind, layer, step, message)

    def _dead(
        self,
        step: int,
        w_idx: np.ndarray,
        w_rows: S.Rows,
        g_idx: Optional[np.ndarray],
        g_rows: S.Rows,
        t_idx: np.ndarray,
        new: list[Alert],
    ) -> None:
        n = self.rules.dead_samples
        trainable = np.zeros(len(self._names), dtype=bool)
        trainable[t_idx] = True
        zero = w_rows.all_zero & trainable[w_idx]  # training cannot revive a frozen weight: not a dead layer
        self._zero_weights[w_idx] = np.where(zero, self._zero_weights[w_idx] + 1, 0)
        for i in np.flatnonzero(self._zero_weights[w_idx] >= n):
            name = self._names[w_idx[i]]
            self._raise(new, "dead", name, step, f"weights of {name} have been all zero for {n} samples "
                        f"(AlertRules.dead_samples is {n}): zeroed by a bug, or a mask or an init run in the loop?")
        if g_idx is None or not len(g_idx):
            return
        layers = [self._layers[i] for i in g_idx]
        zero = g_rows.all_zero
        layer_zero = {layer: True for layer in layers}
        for layer, z in zip(layers, zero):
            layer_zero[layer] = layer_zero[layer] and bool(z)  # a layer is dead when all its gradients are
        zero = np.array([layer_zero[layer] for layer in layers])
        self._zero_grads[g_idx] = np.where(zero, self._zero_grads[g_idx] + 1, 0)
        for i in np.flatnonzero(self._zero_grads[g_idx] >= n):
            self._raise(
                new, "dead", self._names[g_idx[i]], step,
                f"every gradient of layer {layers[i] or ROOT} has been exactly zero for {n} samples "
                f"(AlertRules.dead_samples is {n}): nothing reaches it (a ReLU that never fires, all-zero weights, or "
                "a detached path)",
            )

    def _stuck(
        self,
        step: int,
        w_idx: np.ndarray,
        w_rows: S.Rows,
        grads: Optional[tuple[np.ndarray, S.Rows]],
        t_idx: np.ndarray,
        new: list[Alert],
    ) -> None:
        n = self.rules.stuck_samples
        size = len(self._names)
        has_grad = np.zeros(size, dtype=bool)
        moving_grad = np.zeros(size, dtype=bool)  # a finite, non-zero gradient
        if grads is not None and len(grads[0]):  # with no gradient anywhere the loop, not the model, is wrong
            g_idx, g_rows = grads
            has_grad[g_idx] = True
            moving_grad[g_idx] = ~g_rows.all_zero & g_rows.finite
            self._no_grad[t_idx] = np.where(has_grad[t_idx], 0, self._no_grad[t_idx] + 1)
            for i in t_idx[self._no_grad[t_idx] >= n]:
                name = self._names[i]
                self._raise(new, "stuck", name, step, f"{name} is trainable but has had no gradient for {n} samples "
                            f"(AlertRules.stuck_samples is {n}): does the loss use it, or is its path detached?")
        trainable = np.zeros(size, dtype=bool)
        trainable[t_idx] = True
        fingerprint = w_rows.fingerprint
        seen = ~np.isnan(self._last_weights[w_idx, 0])
        same = np.all(fingerprint == self._last_weights[w_idx], axis=1) & w_rows.finite
        self._moved[w_idx] |= seen & ~same
        # Only weights that never moved: a schedule that ends at lr 0, or Adam on a vanishing
        # gradient, legitimately stops weights that moved before.
        counted = same & moving_grad[w_idx] & trainable[w_idx] & ~self._moved[w_idx]
        self._unchanged[w_idx] = np.where(counted, self._unchanged[w_idx] + 1, 0)
        self._last_weights[w_idx] = fingerprint
        for i in w_idx[self._unchanged[w_idx] >= n]:
            name = self._names[i]
            self._raise(
                new, "stuck", name, step,
                f"{name} has a gradient but has not changed in {n} samples, nor ever before (AlertRules.stuck_samples "
                f"is {n}): is it in the optimizer, with a learning rate above 0?",
            )

    # ------------------------------------------------------------------ helpers

    def _slots(self, names: Iterable[str]) -> np.ndarray:
        """The parameters' indices in the state arrays (new ones get the next indices)."""
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
            self._grow(len(self._names))
        return np.array(indices, dtype=int)

    def _grow(self, size: int) -> None:
        if size <= len(self._unchanged):
            return
        extra = max(size, 2 * len(self._unchanged)) - len(self._unchanged)
        for attr in ("_zero_grads", "_zero_weights", "_unchanged", "_no_grad"):
            setattr(self, attr, np.concatenate([getattr(self, attr), np.zeros(extra, dtype=int)]))
        self._last_weights = np.concatenate([self._last_weights, np.full((extra, S.FINGERPRINT_WIDTH), np.nan)])
        self._moved = np.concatenate([self._moved, np.zeros(extra, dtype=bool)])

    def _stack(self, rows: dict[str, np.ndarray]) -> tuple[np.ndarray, S.Rows]:
        """Indices and stacked rows of ``rows`` (name -> row)."""
        return self._slots(rows), S.Rows.stack(list(rows.values()))

    def report(self, kind: str, layer: str, step: int, message: str) -> list[Alert]:
        """Raise an alert found outside the rules (the runtime probes); [] when already raised."""
        new: list[Alert] = []
        self._raise_for(new, kind, layer, step, message)
        return new

    def _raise(self, new: list[Alert], kind: str, param: str, step: int, message: str) -> None:
        self._raise_for(new, kind, parent(param) or param, step, message)

    def _raise_for(self, new: list[Alert], kind: str, layer: str, step: int, message: str) -> None:
        key = (kind, layer, step) if kind in EVENT_KINDS else (kind, layer)
        if key in self._raised:
            return
        self._raised.add(key)
        alert = Alert(kind, layer, step, message)
        self.alerts.append(alert)
        new.append(alert)


class LayerWindows:
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

    def __init__(self, rules: AlertRules, family: str) -> None:
        self.rules, self.family = rules, family
        self.factor = rules.weight_factor if family == "weights" else rules.grad_factor
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

    def observe(self, step: int, params: np.ndarray, names: list[str], rows: S.Rows) -> list[tuple[str, str, str]]:
        """``(kind, layer, message)`` of each rule broken at this sample, given the finite rows of
        the parameters ``params`` (indices into ``names``)."""
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
        if self.family == "weights":
            return self._weights(judged, before, now)
        share_before, share_now = np.median(self._share[:w, judged], axis=0), np.median(self._share[w:, judged], axis=0)
        raised = share_before > self._share_peak[judged]
        self._share_peak[judged] = np.where(raised, share_before, self._share_peak[judged])
        self._peak_at[judged] = np.where(raised, self._steps[w - 1, judged], self._peak_at[judged])
        top = self._names[present[np.argmax(rms)]]
        return self._gradients(judged, before, now, peak, share_now, top, largest)

    def _weights(self, judged: np.ndarray, before: np.ndarray, now: np.ndarray) -> list[tuple[str, str, str]]:
        found = []
        with np.errstate(divide="ignore", invalid="ignore"):
            for i in np.flatnonzero(now > self.factor * before):
                found.append(("exploding", self._names[judged[i]], self._say(judged[i], "grew", now[i] / before[i], before[i], now[i]) +
                              "is the learning rate too high, or weight decay off?"))
            for i in np.flatnonzero((now * self.factor < before) & (now > 0)):
                found.append(("vanishing", self._names[judged[i]], self._say(judged[i], "shrank", before[i] / now[i], before[i], now[i]) +
                              "is weight decay too strong?"))
        return found

    def _gradients(self, judged: np.ndarray, before: np.ndarray, now: np.ndarray, peak: np.ndarray, share_now: np.ndarray,
                   top: str, largest: float) -> list[tuple[str, str, str]]:
        found, w = [], self.rules.window
        share_peak = self._share_peak[judged]
        with np.errstate(divide="ignore", invalid="ignore"):
            for i in np.flatnonzero((now > self.factor * before) & (now > peak)):
                found.append(("exploding", self._names[judged[i]], self._say(judged[i], "grew", now[i] / before[i], before[i], now[i]) +
                              "above any level before: is the learning rate too high, or a layer without normalization?"))
            for i in np.flatnonzero((share_now * self.factor < share_peak) & (share_now > 0)):
                layer = self._names[judged[i]]
                found.append(("vanishing", layer, (
                    f"gradient of layer {layer or ROOT} fell to {share_now[i]:.3g} of the largest layer's over the last {w} "
                    f"samples (median; RMS per value, now {now[i]:.3g}, {top or ROOT}'s {largest:.3g}): "
                    f"{share_peak[i] / share_now[i]:.3g}x below the {share_peak[i]:.3g} it had over the {w} samples to step "
                    f"{self._peak_at[judged[i]]} (AlertRules.grad_factor is {self.factor:g}). The gradient no longer "
                    "reaches it: look between it and the loss for a saturated activation (sigmoid, tanh) or a detached path")))
        return found

    def _say(self, index: int, how: str, ratio: float, before: float, now: float) -> str:
        option = "weight_factor" if self.family == "weights" else "grad_factor"
        what = "weights" if self.family == "weights" else "gradient"
        return (f"{what} of layer {self._names[index] or ROOT} {how} {ratio:.3g}x over the last {self.rules.window} samples "
                f"(median RMS per value {before:.3g} -> {now:.3g}; AlertRules.{option} is {self.factor:g}): ")

    def _layers_of(self, params: np.ndarray, names: list[str]) -> np.ndarray:
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


class UpdateShape:
    """The rules on Adam's own state, per layer: the module that owns the parameters, its
    tensors' coordinates pooled (a key projection's bias, whose gradient is rounding noise by
    construction, is ε-bound and sign-like alone, and says nothing of its layer).

    - ``sign_like``: the layer's normalized update RMS (:mod:`~layerwatch.measure.optimizer_state`),
      its median over the last ``window`` samples, is at least ``sign_like_rms`` and at least
      ``sign_like_factor`` times the lowest median of a window before: updates that grew from
      noise-like (0.2-0.3) to sign-like (1), the state Molybog et al. (2023) find before Adam
      diverges. Its first ``window`` samples are a baseline, never judged: every update is
      sign-like at Adam's first step.
    - ``eps_bound``: more than ``eps_bound_frac`` of the layer's coordinates with a gradient
      have ``√v̂ < 10ε``, at ``window`` samples in a row: ε, not the gradient, sets their steps
      (Wortsman et al. 2023).
    """

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self._layer_of: dict[str, int] = {}  # parameter -> layer index
        self._index: dict[str, int] = {}  # layer -> its index
        self._layers: list[str] = []
        self._rms = Windows(rules.window)
        self._eps_run: list[int] = []  # per layer, samples in a row above eps_bound_frac

    def restart(self) -> None:
        """Judge growth afresh from here (:meth:`Windows.restart`)."""
        self._rms.restart()

    def observe(self, names: list[str], rows: np.ndarray, turned: bool = True) -> list[tuple[str, str, str]]:
        """``(kind, layer, message)`` of each rule broken, given the rows read after a step;
        ``sign_like`` only where the loss has ``turned``."""
        idx = np.array([self._slot(name) for name in names], dtype=int)
        size = len(self._layers)
        sums = {col: np.bincount(idx, rows[:, col], minlength=size) for col in (UPDATE_SUMSQ, VALUES, EPS_BOUND, SEEN)}
        w, found = self.rules.window, []
        with np.errstate(divide="ignore", invalid="ignore"):
            rms = np.sqrt(sums[UPDATE_SUMSQ] / sums[VALUES])
            share = sums[EPS_BOUND] / sums[SEEN]
        for i in np.unique(idx).tolist():
            layer = self._layers[i] or ROOT
            trend = self._rms.add(self._layers[i], float(rms[i]))
            if trend is not None:
                _, now, lowest, _ = trend
                if turned and now >= self.rules.sign_like_rms and now >= self.rules.sign_like_factor * lowest:
                    found.append(("sign_like", self._layers[i], (
                        f"Adam's updates of layer {layer} turned sign-like: normalized update RMS {now:.2f} over the last "
                        f"{w} samples (median), {now / lowest:.3g}x its lowest window's {lowest:.2f} (AlertRules."
                        f"sign_like_rms is {self.rules.sign_like_rms:g}, sign_like_factor {self.rules.sign_like_factor:g}): "
                        "each coordinate moves by about the learning rate whatever its gradient, as before Adam diverges "
                        "(Molybog et al. 2023). Is the learning rate too high, or β2 too low for this batch size?")))
            bound = bool(sums[SEEN][i] > 0 and share[i] > self.rules.eps_bound_frac)
            self._eps_run[i] = self._eps_run[i] + 1 if bound else 0
            if self._eps_run[i] >= w:
                found.append(("eps_bound", self._layers[i], (
                    f"{share[i]:.0%} of layer {layer}'s coordinates with a gradient have √v̂ below 10x Adam's eps, at {w} "
                    f"samples in a row (AlertRules.eps_bound_frac is {self.rules.eps_bound_frac:g}): eps, not the gradient, "
                    "sets their steps and they barely move. Lower eps (OLMo 2 went from 1e-5 to 1e-8), or scale the loss up?")))
        return found

    def _slot(self, name: str) -> int:
        index = self._layer_of.get(name)
        if index is None:
            layer = parent(name)
            index = self._index.setdefault(layer, len(self._layers))
            if index == len(self._layers):
                self._layers.append(layer)
                self._eps_run.append(0)
            self._layer_of[name] = index
        return index


class Windows:
    """Each layer's last ``2 * window`` values of one signal: the medians of the window before
    and of the last one, and the lowest and highest median a window before ever had."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._values: dict[str, list[float]] = {}
        self._extremes: dict[str, tuple[float, float]] = {}
        self._restarted: set[str] = set()  # layers whose extremes start again from their last window
        self._since: dict[str, int] = {}  # samples since a layer's restart, while its windows before reach past it

    def restart(self) -> None:
        """Judge growth from here on (the loss made progress): each layer's extremes become the
        median of the window that ends at its next sample, and the windows before it are not
        folded in until they lie after that window's start."""
        self._restarted.update(self._values)

    def add(self, layer: str, value: float) -> Optional[tuple[float, float, float, float]]:
        """``value`` at this sample; once two windows are full, ``(before, now, lowest, highest)``."""
        if not np.isfinite(value):
            return None
        values = self._values.setdefault(layer, [])
        values.append(value)
        del values[:-2 * self.window]
        if len(values) < 2 * self.window:
            return None
        before, now = float(np.median(values[:self.window])), float(np.median(values[self.window:]))
        if layer in self._restarted:  # from the window that ends at the restart
            self._restarted.discard(layer)
            self._extremes[layer], self._since[layer] = (now, now), 0
        since = self._since.get(layer)
        if since is not None and since < self.window:  # the window before began before the restart
            self._since[layer] = since + 1
            lowest, highest = self._extremes[layer]
            return before, now, lowest, highest
        self._since.pop(layer, None)
        lowest, highest = self._extremes.get(layer, (before, before))
        self._extremes[layer] = lowest, highest = min(lowest, before), max(highest, before)
        return before, now, lowest, highest


class ProbeTrends:
    """The rules on the probes' transformer signals, each judged against the layer's own past:

    - ``outlier_growth``: a module output's ``max|h| / RMS(h)`` window median ``outlier_growth``
      times the lowest of a window before, or its per-channel kurtosis ``kurtosis_growth`` times.
    - ``logit_drift``: the output head's mean log Z, its window median more than ``logit_drift``
      nats from its first window's.

    The attention rules, per attention module with its heads folded (the largest logit of any
    head, the lowest entropy of any head):

    - ``attention_logits``: the largest logit at or above ``attention_logit_level`` (100, the
      level Kimi K2's QK-Clip and Megatron clip at); or, from a tenth of it, the window median
      at least ``attention_logit_growth`` times the lowest median of a window before. Judged
      against the layer's own past below the level: healthy logits grow several times from
      their initial ~0.1 (the zoo's BERT: 0.1 to 0.5 in 36 steps), and a small model can fail
      before any logit reaches 100 (Wortsman et al. 2023).
    - ``entropy_collapse``: the lowest head entropy's window median below ``entropy_collapse``
      times the highest median of a window before: attention turning one-hot (Zhai et al. 2023).
      Against the layer's own past: attention sinks keep some heads low in healthy models.
    """

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self._logits, self._entropy, self._log_z = Windows(rules.window), Windows(rules.window), Windows(rules.window)
        self._outliers, self._kurtosis = Windows(rules.window), Windows(rules.window)
        self._first: dict[str, float] = {}  # the output head's first window median of log Z

    def restart(self) -> None:
        """Judge growth afresh from here (:meth:`Windows.restart`); ``logit_drift`` keeps its first window."""
        for windows in (self._logits, self._entropy, self._outliers, self._kurtosis):
            windows.restart()

    def observe(self, probes: Any, turned: bool = True) -> list[tuple[str, str, str]]:
        """``(kind, layer, message)`` of each rule broken by a :class:`~layerwatch.probes.ProbeResult`;
        the growth rules only where the loss has ``turned`` (their windows are kept all the same)."""
        found, rules = [], self.rules
        for values, windows, factor, what, option in (
                (outliers_of(probes), self._outliers, rules.outlier_growth, "max|h| / RMS(h)", "outlier_growth"),
                (probes.kurtosis, self._kurtosis, rules.kurtosis_growth, "the kurtosis of its per-channel RMS",
                 "kurtosis_growth")):
            for layer, value in values.items():
                trend = windows.add(layer, value)
                if turned and trend is not None and trend[1] >= factor * trend[2] > 0:
                    _, now, lowest, _ = trend
                    found.append(("outlier_growth", layer, (
                        f"the output of {layer} grew outliers: {what} {lowest:.3g} -> {now:.3g} (medians of {rules.window} "
                        f"samples, {now / lowest:.3g}x its lowest window; AlertRules.{option} is {factor:g}): a few "
                        "values or channels dwarf the rest, as outlier features and massive activations do (Sun et al. "
                        "2024) before they break low-precision training or the loss")))
        if probes.logits is not None:
            head, (mean, _) = probes.logits
            trend = self._log_z.add(head, float(mean))
            if trend is not None:
                first = self._first.setdefault(head, trend[0])
                now = trend[1]
                if turned and abs(now - first) > rules.logit_drift:
                    found.append(("logit_drift", head, (
                        f"the output head {head}'s log Z (logsumexp of a token's logits, mean) drifted from {first:.3g} to "
                        f"{now:.3g} nats (medians of {rules.window} samples; AlertRules.logit_drift is {rules.logit_drift:g}): "
                        "the softmax and the loss do not see it, and it comes before divergence late in training. "
                        "A z-loss (PaLM: 1e-4 (log Z)^2)?")))
        for layer, heads in probes.attention.items():
            logit = float(np.nanmax(heads[:, 0])) if np.isfinite(heads[:, 0]).any() else float("nan")
            if logit >= rules.attention_logit_level:
                found.append(("attention_logits", layer, (
                    f"largest attention logit of layer {layer} is {logit:.4g}, at or above {rules.attention_logit_level:g} "
                    f"(AlertRules.attention_logit_level; Kimi K2's QK-Clip and Megatron clip there): attention turns one-hot, "
                    "then training diverges (Dehghani et al. 2023). QK-norm, or a lower learning rate?")))
            trend = self._logits.add(layer, logit)
            if trend is not None:
                _, now, lowest, _ = trend
                if turned and now >= rules.attention_logit_level / 10 and now >= rules.attention_logit_growth * lowest > 0:
                    found.append(("attention_logits", layer, (
                        f"largest attention logit of layer {layer} grew {now / lowest:.3g}x over its lowest window: "
                        f"{lowest:.3g} -> {now:.3g} (median of {rules.window} samples; AlertRules.attention_logit_growth is "
                        f"{rules.attention_logit_growth:g}): logit growth comes before one-hot attention and divergence "
                        "(Wortsman et al. 2023). QK-norm, or a lower learning rate?")))
            entropies = heads[:, 1]
            entropy = float(np.nanmin(entropies)) if np.isfinite(entropies).any() else float("nan")
            trend = self._entropy.add(layer, entropy)
            if trend is not None:
                _, now, _, highest = trend
                if turned and now < rules.entropy_collapse * highest:
                    found.append(("entropy_collapse", layer, (
                        f"attention entropy of layer {layer} collapsed to {now:.3g} nats (its lowest head, median of "
                        f"{rules.window} samples), {now / highest if highest else 0:.2g} of the {highest:.3g} it had (AlertRules."
                        f"entropy_collapse is {rules.entropy_collapse:g}): a head attends to one key, which comes with "
                        "oscillating loss and divergence (Zhai et al. 2023)")))
        return found


class HealthCheck:
    """The rules applied to each sampled step's rows: what they find, as
    :class:`~layerwatch.sinks.record.Findings` for the record (never written into it)."""

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
        found: Sequence[Alert] = (),
        probes: Any = None,
    ) -> Findings:
        """The findings of ``step``: ``found`` (alerts found outside the rules: the first
        offender) raised first, then the rules' on the weights' and gradients' rows, Adam's state and
        the ``probes``' result (:class:`~layerwatch.probes.ProbeResult`: attention, output logits).
        ``stepped`` is False when the optimizer skipped the step (None: not known)."""
        def by_name(family: str) -> dict[str, np.ndarray]:
            return {name: row for names, family_rows in rows.get(family, ()) for name, row in zip(names, family_rows)}

        new: list[Alert] = []
        for alert in found:
            new += self.monitor.report(alert.kind, alert.name, alert.step, alert.message)  # a spike's step is its own
        grads = by_name("grads") if grads_read else None
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
        new += self.monitor.observe(step, weights=by_name("weights"), grads=grads, trainable=trainable,
                                    adam=rows.get("adam", ()), probes=probes, loss=self.progress.context())
        return Findings(alerts=new, alert_count=len(self.monitor.alerts),
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


def outliers_of(probes: Any) -> dict[str, float]:
    """Each measured module output's ``max|h| / RMS(h)`` (finite ones) in a probes' result."""
    measured = [t for t in probes.modules if t.activation_row is not None]
    if not measured:
        return {}
    ratios = S.Rows(np.stack([t.activation_row for t in measured])).peak_to_rms
    return {t.name: float(r) for t, r in zip(measured, ratios) if np.isfinite(r)}
