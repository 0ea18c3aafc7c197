"""``dead``: every gradient of a layer exactly zero, or a trainable parameter's weights all zero,
for ``AlertRules.dead_samples`` samples in a row.

A frozen parameter cannot be revived by training, so a frozen zero bias (a LoRA run's) is not
dead; a layer's gradients count only when all of them are zero together (a structurally zero
bias gradient beside a live weight's is not a dead layer).
"""

from __future__ import annotations

import numpy as np

from layerwatch.health.rules.rule import Broken, Rule, Seen, grown, owner
from layerwatch.options import AlertRules
from layerwatch.vocabulary import ROOT


class Dead(Rule):
    """Counts, per parameter, the samples in a row its weights, or its layer's gradients, were all zero."""

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self._zero_weights = np.zeros(0, dtype=int)
        self._zero_grads = np.zeros(0, dtype=int)

    def observe(self, seen: Seen) -> list[Broken]:
        self._zero_weights = grown(self._zero_weights, len(seen.names), 0)
        self._zero_grads = grown(self._zero_grads, len(seen.names), 0)
        return self._weights(seen) + self._gradients(seen)

    def _weights(self, seen: Seen) -> list[Broken]:
        n = self.rules.dead_samples
        w_idx, w_rows = seen.weights
        trainable = np.zeros(len(seen.names), dtype=bool)
        trainable[seen.trainable] = True
        zero = w_rows.all_zero & trainable[w_idx]  # training cannot revive a frozen weight: not a dead layer
        self._zero_weights[w_idx] = np.where(zero, self._zero_weights[w_idx] + 1, 0)
        return [Broken("dead", owner(name), f"weights of {name} have been all zero for {n} samples (AlertRules."
                        f"dead_samples is {n}): zeroed by a bug, or a mask or an init run in the loop?")
                for name in (seen.names[w_idx[i]] for i in np.flatnonzero(self._zero_weights[w_idx] >= n))]

    def _gradients(self, seen: Seen) -> list[Broken]:
        n = self.rules.dead_samples
        if seen.grads is None or not len(seen.grads.slots):
            return []
        g_idx, g_rows = seen.grads
        layers = [seen.layers[i] for i in g_idx]
        layer_zero = {layer: True for layer in layers}
        for layer, z in zip(layers, g_rows.all_zero):
            layer_zero[layer] = layer_zero[layer] and bool(z)  # a layer is dead when all its gradients are
        zero = np.array([layer_zero[layer] for layer in layers])
        self._zero_grads[g_idx] = np.where(zero, self._zero_grads[g_idx] + 1, 0)
        return [Broken("dead", owner(seen.names[g_idx[i]]), f"every gradient of layer {layers[i] or ROOT} has been "
                        f"exactly zero for {n} samples (AlertRules.dead_samples is {n}): nothing reaches it (a ReLU that "
                        "never fires, all-zero weights, or a detached path)")
                for i in np.flatnonzero(self._zero_grads[g_idx] >= n)]
