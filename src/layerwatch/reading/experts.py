"""A run's Mixture-of-Experts routers read back from the tab's data: each router's tokens per
expert at each sampled step (the ``moe_tokens`` series, one row ``<router>#<e>`` an expert),
their shares, the balancing bias where a router has one, and the imbalance the writer recorded.
One reading for the notebook (``load_experts``), the tab (its ``experts`` route) and
``layerwatch report`` (:func:`most_imbalanced`, :func:`dead_now`); the quantities themselves are
:mod:`layerwatch.routing`'s. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from layerwatch import vocabulary as V
from layerwatch.reading.events import Reader
from layerwatch.routing import dead_experts, shares


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


def most_imbalanced(experts: Experts, top: int = 5) -> list[dict[str, Any]]:
    """The routers by their imbalance at their latest sample, the largest first: ``router``,
    ``step``, ``imbalance``, and the run's largest, ``max`` at ``max_step``."""
    found = []
    for r, router in enumerate(experts.routers):
        row = experts.imbalance[r]
        written = np.flatnonzero(np.isfinite(row))
        if written.size:
            latest, largest = written[-1], written[np.argmax(row[written])]
            found.append({"router": router, "step": experts.steps[latest], "imbalance": float(row[latest]),
                          "max": float(row[largest]), "max_step": experts.steps[largest]})
    return sorted(found, key=lambda item: -item["imbalance"])[:top]


def dead_now(experts: Experts) -> list[dict[str, Any]]:
    """The experts given no token at their router's latest sample (:func:`layerwatch.routing.dead_experts`),
    the longest dead first: ``router``, ``expert``, ``since`` (the first step of the samples
    without a token that run up to the latest), ``samples`` (how many) and ``last_step``."""
    found = []
    for i in range(experts.tokens.shape[0]):
        measured = np.flatnonzero(np.isfinite(experts.tokens[i]))
        dead = dead_experts(experts.tokens[i, measured])
        if not dead.size or not dead[-1]:
            continue
        alive = np.flatnonzero(~dead)
        first = int(alive[-1]) + 1 if alive.size else 0
        found.append({"router": experts.routers[experts.router[i]], "expert": int(experts.expert[i]),
                      "since": experts.steps[measured[first]], "samples": int(dead.size - first),
                      "last_step": experts.steps[measured[-1]]})
    return sorted(found, key=lambda item: -item["samples"])  # stable: model order among equals
