"""A run's Mixture-of-Experts routers read back from the tab's data: each router's tokens per
expert at each sampled step (the ``moe_tokens`` series, one row ``<router>#<e>`` an expert),
their shares, the balancing bias where a router has one, and the imbalance the writer recorded.
One reading for the notebook (``load_experts``), the tab (its ``experts`` route) and
``layerwatch report``; the quantities themselves are :mod:`layerwatch.routing`'s. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from layerwatch import vocabulary as V
from layerwatch.reading.events import Reader
from layerwatch.routing import shares


@dataclass
class Experts:
    """The routers of a run: ``tokens[i, j]`` is row ``i`` (expert ``expert[i]`` of router
    ``routers[router[i]]``) at ``steps[j]``; -inf where the router was not measured at that step.
    Rows run router by router, in model order (the layout's), each router's experts in order."""

    routers: list[str]
    router: np.ndarray  # int64 [rows]: the index of the row's router in ``routers``
    expert: np.ndarray  # int64 [rows]: the row's expert
    steps: list[int]
    tokens: np.ndarray  # float64 [rows, steps]
    bias: Optional[np.ndarray]  # float64 [rows, steps], -inf where none (a router without a bias); None: no router has one
    imbalance: np.ndarray  # float64 [routers, steps] as written (``moe_imbalance``); -inf where not written

    @property
    def counts(self) -> list[int]:
        """Each router's number of experts."""
        return np.bincount(self.router, minlength=len(self.routers)).tolist()

    def shares(self) -> np.ndarray:
        """Each row's share of its router's tokens at each step (:func:`layerwatch.routing.shares`):
        NaN where the router routed no token, -inf where it was not measured."""
        out = np.full(self.tokens.shape, -np.inf)
        for r in range(len(self.routers)):
            rows = np.flatnonzero(self.router == r)
            block = self.tokens[rows]
            measured = np.isfinite(block).all(axis=0)
            out[np.ix_(rows, np.flatnonzero(measured))] = shares(block[:, measured].T).T
        return out


def experts_of(reader: Reader) -> Optional[Experts]:
    """The routers in ``reader`` (their ``moe_tokens``), or None when it has none."""
    if V.MOE_TOKENS not in reader.keys():
        return None
    names, steps, tokens = reader.matrix(V.MOE_TOKENS)
    parsed = [_router_and_expert(name) for name in names]
    keep = [i for i, found in enumerate(parsed) if found is not None]
    routers = list(dict.fromkeys(parsed[i][0] for i in keep))
    index = {name: r for r, name in enumerate(routers)}
    order = sorted(keep, key=lambda i: (index[parsed[i][0]], parsed[i][1]))
    router = np.array([index[parsed[i][0]] for i in order], dtype=np.int64)
    expert = np.array([parsed[i][1] for i in order], dtype=np.int64)
    rows = [V.expert_name(routers[r], e) for r, e in zip(router.tolist(), expert.tolist())]
    return Experts(routers, router, expert, steps, tokens[order].astype(np.float64),
                   _aligned(reader, V.MOE_BIAS, rows, steps) if V.MOE_BIAS in reader.keys() else None,
                   _aligned(reader, V.MOE_IMBALANCE, routers, steps))


def _router_and_expert(name: str) -> Optional[tuple[str, int]]:
    """``(router, expert)`` of a row ``<router>#<e>`` (:func:`~layerwatch.vocabulary.expert_name`)."""
    router, hash_sign, expert = name.rpartition("#")
    return (router, int(expert)) if hash_sign and expert.isdecimal() else None


def _aligned(reader: Reader, key: str, rows: list[str], steps: list[int]) -> np.ndarray:
    """The series ``key`` as ``rows`` x ``steps`` (float64; -inf where it has no value)."""
    if key not in reader.keys():
        return np.full((len(rows), len(steps)), -np.inf)
    names, at, matrix = reader.matrix(key)
    out = np.full((len(rows), len(steps)), -np.inf)
    row_of = {name: i for i, name in enumerate(names)}
    column = {step: j for j, step in enumerate(steps)}
    cols = [(column[s], j) for j, s in enumerate(at) if s in column]
    if not cols:
        return out
    into, source = (np.array(c, dtype=np.int64) for c in zip(*cols))
    for i, name in enumerate(rows):
        if name in row_of:
            out[i, into] = matrix[row_of[name], source]
    return out
