"""The load of a Mixture-of-Experts router, from its tokens per expert: how unevenly they are
spread (:func:`imbalance`), each expert's part of them (:func:`shares`), the experts left without
any (:func:`dead_experts`), how far the busiest one went toward taking every token
(:func:`concentration`). One home for each: the probes' ``RouterLoad``, the notebook, the
LAYERWATCH tab and ``layerwatch report`` all read them here. NumPy only, no torch: TensorBoard's
process imports it with the tab."""

from __future__ import annotations

from typing import Optional

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


def concentration(tokens: np.ndarray, top_k: Optional[int]) -> float:
    """How far the busiest expert's share of the tokens (tokens routed to it over the tokens
    routed, each token counted once: ``imbalance * k / E``) has gone from its fair share ``k/E``
    (``top_k`` of ``E`` experts) toward every token: 0 balanced, 1 when every token goes to it.
    It bounds the top-k experts' combined share of the routed tokens from above (both are fair
    at ``k/E`` and 1 when the same ``k`` experts take every token), and reaches 1 also where a
    single expert takes every token beside changing others. NaN when no token was routed, or
    ``top_k`` is unknown or leaves no choice (``k >= E``)."""
    experts = tokens.shape[0]
    if top_k is None or not 0 < top_k < experts:
        return float("nan")
    fair = top_k / experts
    return (imbalance(tokens) * fair - fair) / (1 - fair)
