"""``stuck``: a trainable parameter that has a non-zero gradient but whose weights have not
changed between samples, and never changed before, for ``AlertRules.stuck_samples`` samples in a
row; or that has had no gradient at all for as long.

Only weights that never moved count: a schedule that ends at a learning rate of 0, or Adam on a
vanishing gradient, legitimately stops weights that moved before. A step where no parameter has
a gradient says nothing of any one (the loop, not the model, is wrong then).
"""

from __future__ import annotations

import numpy as np

from layerwatch import stats as S
from layerwatch.health.rules.rule import Broken, Rule, Seen, grown, owner
from layerwatch.options import AlertRules


class Stuck(Rule):
    """Counts, per parameter, the samples in a row it had no gradient, or a gradient and the same weights."""

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self._unchanged = np.zeros(0, dtype=int)
        self._no_grad = np.zeros(0, dtype=int)
        self._last_weights = np.full((0, S.FINGERPRINT_WIDTH), np.nan)
        self._moved = np.zeros(0, dtype=bool)  # the weights changed between two samples, ever

    def observe(self, seen: Seen) -> list[Broken]:
        size = len(seen.names)
        self._unchanged, self._no_grad = grown(self._unchanged, size, 0), grown(self._no_grad, size, 0)
        self._last_weights, self._moved = grown(self._last_weights, size, np.nan), grown(self._moved, size, False)
        moving_grad = np.zeros(size, dtype=bool)  # a finite, non-zero gradient
        found = []
        if seen.grads is not None and len(seen.grads.slots):  # with no gradient anywhere the loop, not the model, is wrong
            found = self._no_gradient(seen, moving_grad)
        return found + self._unmoved(seen, moving_grad)

    def _no_gradient(self, seen: Seen, moving_grad: np.ndarray) -> list[Broken]:
        n, t_idx = self.rules.stuck_samples, seen.trainable
        g_idx, g_rows = seen.grads
        has_grad = np.zeros(len(seen.names), dtype=bool)
        has_grad[g_idx] = True
        moving_grad[g_idx] = ~g_rows.all_zero & g_rows.finite
        self._no_grad[t_idx] = np.where(has_grad[t_idx], 0, self._no_grad[t_idx] + 1)
        return [Broken("stuck", owner(name), f"{name} is trainable but has had no gradient for {n} samples "
                        f"(AlertRules.stuck_samples is {n}): does the loss use it, or is its path detached?")
                for name in (seen.names[i] for i in t_idx[self._no_grad[t_idx] >= n])]

    def _unmoved(self, seen: Seen, moving_grad: np.ndarray) -> list[Broken]:
        n = self.rules.stuck_samples
        w_idx, w_rows = seen.weights
        trainable = np.zeros(len(seen.names), dtype=bool)
        trainable[seen.trainable] = True
        fingerprint = w_rows.fingerprint
        known = ~np.isnan(self._last_weights[w_idx, 0])
        same = np.all(fingerprint == self._last_weights[w_idx], axis=1) & w_rows.finite
        self._moved[w_idx] |= known & ~same
        counted = same & moving_grad[w_idx] & trainable[w_idx] & ~self._moved[w_idx]
        self._unchanged[w_idx] = np.where(counted, self._unchanged[w_idx] + 1, 0)
        self._last_weights[w_idx] = fingerprint
        return [Broken("stuck", owner(name), f"{name} has a gradient but has not changed in {n} samples, nor ever "
                        f"before (AlertRules.stuck_samples is {n}): is it in the optimizer, with a learning rate above 0?")
                for name in (seen.names[i] for i in w_idx[self._unchanged[w_idx] >= n])]
