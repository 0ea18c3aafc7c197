"""``attention_logits``, ``entropy_collapse``, ``logit_drift``, ``outlier_growth``: the probes'
transformer signals, each judged against the layer's own past (a module's, an attention
module's with its heads folded, the output head's).

Thresholds (``AlertRules``): ``attention_logit_level`` (100: Kimi K2's QK-Clip and Megatron clip
there; Dehghani et al. 2023) and ``attention_logit_growth`` (Wortsman et al. 2023),
``entropy_collapse`` (Zhai et al. 2023), ``logit_drift`` (nats of the output head's mean log Z;
PaLM's z-loss stops the drift), ``outlier_growth`` and ``kurtosis_growth`` (Sun et al. 2024;
He et al. 2024), ``window``. All but the absolute level of ``attention_logits`` are growth rules
(``GROWTH_KINDS``): they judge once the loss has turned, afresh from its lowest.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from layerwatch import stats as S
from layerwatch.health.rules.rule import Broken, Rule, Seen
from layerwatch.health.rules.windows import Windows
from layerwatch.options import AlertRules


class ProbeTrends(Rule):
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

    def observe(self, seen: Seen) -> list[Broken]:
        """Each rule broken by the step's :class:`~layerwatch.probes.ProbeResult`; the growth rules
        only where the loss has turned (their windows are kept all the same)."""
        probes = seen.probes
        if probes is None:
            return []
        return self._outliers_found(probes, seen.turned) + self._drift(probes, seen.turned) + \
            self._attention(probes, seen.turned)

    def _outliers_found(self, probes: Any, turned: bool) -> list[Broken]:
        found, rules = [], self.rules
        for values, windows, factor, what, option in (
                (outliers_of(probes), self._outliers, rules.outlier_growth, "max|h| / RMS(h)", "outlier_growth"),
                (probes.kurtosis, self._kurtosis, rules.kurtosis_growth, "the kurtosis of its per-channel RMS",
                 "kurtosis_growth")):
            for layer, value in values.items():
                trend = windows.add(layer, value)
                if turned and trend is not None and trend.grew(factor):
                    _, now, lowest, _ = trend
                    found.append(Broken("outlier_growth", layer, (
                        f"the output of {layer} grew outliers: {what} {lowest:.3g} -> {now:.3g} (medians of {rules.window} "
                        f"samples, {now / lowest:.3g}x its lowest window; AlertRules.{option} is {factor:g}): a few "
                        "values or channels dwarf the rest, as outlier features and massive activations do (Sun et al. "
                        "2024) before they break low-precision training or the loss")))
        return found

    def _drift(self, probes: Any, turned: bool) -> list[Broken]:
        rules = self.rules
        if probes.logits is None:
            return []
        head, (mean, _) = probes.logits
        trend = self._log_z.add(head, float(mean))
        if trend is None:
            return []
        first = self._first.setdefault(head, trend[0])
        now = trend[1]
        if not (turned and abs(now - first) > rules.logit_drift):
            return []
        return [Broken("logit_drift", head, (
            f"the output head {head}'s log Z (logsumexp of a token's logits, mean) drifted from {first:.3g} to "
            f"{now:.3g} nats (medians of {rules.window} samples; AlertRules.logit_drift is {rules.logit_drift:g}): "
            "the softmax and the loss do not see it, and it comes before divergence late in training. "
            "A z-loss (PaLM: 1e-4 (log Z)^2)?"))]

    def _attention(self, probes: Any, turned: bool) -> list[Broken]:
        found, rules = [], self.rules
        for layer, heads in probes.attention.items():
            logit = float(np.nanmax(heads[:, 0])) if np.isfinite(heads[:, 0]).any() else float("nan")
            if logit >= rules.attention_logit_level:
                found.append(Broken("attention_logits", layer, (
                    f"largest attention logit of layer {layer} is {logit:.4g}, at or above {rules.attention_logit_level:g} "
                    f"(AlertRules.attention_logit_level; Kimi K2's QK-Clip and Megatron clip there): attention turns one-hot, "
                    "then training diverges (Dehghani et al. 2023). QK-norm, or a lower learning rate?")))
            trend = self._logits.add(layer, logit)
            if trend is not None:
                _, now, lowest, _ = trend
                if turned and now >= rules.attention_logit_level / 10 and trend.grew(rules.attention_logit_growth):
                    found.append(Broken("attention_logits", layer, (
                        f"largest attention logit of layer {layer} grew {now / lowest:.3g}x over its lowest window: "
                        f"{lowest:.3g} -> {now:.3g} (median of {rules.window} samples; AlertRules.attention_logit_growth is "
                        f"{rules.attention_logit_growth:g}): logit growth comes before one-hot attention and divergence "
                        "(Wortsman et al. 2023). QK-norm, or a lower learning rate?")))
            entropies = heads[:, 1]
            entropy = float(np.nanmin(entropies)) if np.isfinite(entropies).any() else float("nan")
            trend = self._entropy.add(layer, entropy)
            if trend is not None:
                _, now, _, highest = trend
                if turned and trend.fell(rules.entropy_collapse):
                    found.append(Broken("entropy_collapse", layer, (
                        f"attention entropy of layer {layer} collapsed to {now:.3g} nats (its lowest head, median of "
                        f"{rules.window} samples), {now / highest if highest else 0:.2g} of the {highest:.3g} it had (AlertRules."
                        f"entropy_collapse is {rules.entropy_collapse:g}): a head attends to one key, which comes with "
                        "oscillating loss and divergence (Zhai et al. 2023)")))
        return found


def outliers_of(probes: Any) -> dict[str, float]:
    """Each measured module output's ``max|h| / RMS(h)`` (finite ones) in a probes' result."""
    measured = [t for t in probes.modules if t.activation_row is not None]
    if not measured:
        return {}
    ratios = S.Rows(np.stack([t.activation_row for t in measured])).peak_to_rms
    return {t.name: float(r) for t, r in zip(measured, ratios) if np.isfinite(r)}
