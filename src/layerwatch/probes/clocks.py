"""The clocks the hooks mark: the host's, or CUDA events read once after the step."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

import numpy as np
import torch


class HostClock:
    def mark(self) -> int:
        return time.perf_counter_ns()

    def resolve(self, marks: list[Any]) -> np.ndarray:
        return np.asarray(marks, dtype=np.float64) / 1e6


class CudaClock:
    """CUDA events recorded in hooks; read once, after the step. The events are kept from one
    sampled step to the next (``events``): a hook records the next one and keeps its number,
    where a new event per mark cost a driver call and an object for the garbage collector."""

    def __init__(self, events: list[Any], make: Optional[Callable[[], Any]] = None) -> None:
        self._events = events
        self._make = make or functools.partial(torch.cuda.Event, enable_timing=True)
        self._used = 0

    def mark(self) -> int:
        index = self._used
        if index == len(self._events):
            self._events.append(self._make())
        self._events[index].record()
        self._used += 1
        return index

    def resolve(self, marks: list[int]) -> np.ndarray:
        if not marks:
            return np.zeros(0)
        events = self._events
        events[marks[-1]].synchronize()
        base = events[marks[0]]
        return np.array([0.0] + [base.elapsed_time(events[m]) for m in marks[1:]])

