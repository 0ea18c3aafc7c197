"""``sign_like`` / ``eps_bound``: Adam's own state, per layer (the module that owns the
parameters, its tensors' coordinates pooled), from the sums
:mod:`~layerwatch.measure.optimizer_state` reads after the step.

Thresholds (``AlertRules``): ``sign_like_rms`` and ``sign_like_factor`` (the normalized update
RMS's window median at least that level and that many times its lowest window's: Molybog et al.
2023), ``eps_bound_frac`` (the share of coordinates with ``√v̂ < 10ε``, at ``window`` samples in
a row: Wortsman et al. 2023), ``window``. ``sign_like`` is a growth rule (``GROWTH_KINDS``): it
judges once the loss has turned, afresh from its lowest.
"""

from __future__ import annotations

import numpy as np

from layerwatch.health.rules.rule import Broken, Rule, Seen
from layerwatch.health.rules.windows import Windows
from layerwatch.measure.optimizer_state import EPS_BOUND, SEEN, UPDATE_SUMSQ, VALUES
from layerwatch.options import AlertRules
from layerwatch.vocabulary import ROOT, parent


class UpdateShape(Rule):
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

    def observe(self, seen: Seen) -> list[Broken]:
        """Each rule broken, given Adam's rows read after the step; ``sign_like`` only where the
        loss has turned."""
        if not seen.adam:
            return []
        names = [name for names, _ in seen.adam for name in names]
        return self._judge(names, np.concatenate([rows for _, rows in seen.adam]), seen.turned)

    def _judge(self, names: list[str], rows: np.ndarray, turned: bool) -> list[Broken]:
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
                    found.append(Broken("sign_like", self._layers[i], (
                        f"Adam's updates of layer {layer} turned sign-like: normalized update RMS {now:.2f} over the last "
                        f"{w} samples (median), {now / lowest:.3g}x its lowest window's {lowest:.2f} (AlertRules."
                        f"sign_like_rms is {self.rules.sign_like_rms:g}, sign_like_factor {self.rules.sign_like_factor:g}): "
                        "each coordinate moves by about the learning rate whatever its gradient, as before Adam diverges "
                        "(Molybog et al. 2023). Is the learning rate too high, or β2 too low for this batch size?")))
            bound = bool(sums[SEEN][i] > 0 and share[i] > self.rules.eps_bound_frac)
            self._eps_run[i] = self._eps_run[i] + 1 if bound else 0
            if self._eps_run[i] >= w:
                found.append(Broken("eps_bound", self._layers[i], (
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
