"""The load of a Mixture-of-Experts router, from its tokens per expert: how unevenly they are
spread (:func:`imbalance`), each expert's part of them (:func:`shares`), the experts left without
any (:func:`dead_experts`). One home for each: the probes' ``RouterLoad``, the notebook, the
LAYERWATCH tab and ``layerwatch report`` all read them here. NumPy only, no torch: TensorBoard's
process imports it with the tab."""

from __future__ import annotations

import numpy as np


def imbalance(tokens: np.ndarray) -> float:
    """max / mean of the tokens per expert (1: balanced); NaN when none was routed."""
    mean = float(tokens.mean()) if tokens.size else 0.0
    return float(tokens.max()) / mean if mean > 0 else float("nan")


def shares(tokens: np.ndarray) -> np.ndarray:
    """Each expert's share of the routed tokens, along the last axis (``[..., experts]``: they
    sum to 1); NaN where none was routed. Float64."""
    tokens = np.asarray(tokens, dtype=np.float64)
    total = tokens.sum(axis=-1, keepdims=True)
    routed = total > 0
    return np.where(routed, tokens / np.where(routed, total, 1.0), np.nan)


def dead_experts(tokens: np.ndarray) -> np.ndarray:
    """Which experts got no token (a boolean mask of ``tokens``' shape)."""
    return np.asarray(tokens) == 0
