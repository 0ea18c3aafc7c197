"""The timing (and the call counting) the benchmarks share."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch


def median_ms(action: Callable[[], object], calls: int = 15) -> float:
    """The median of ``calls`` timed calls of ``action`` (after one untimed), in ms."""
    action()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def counted_calls(action: Callable[[], object]) -> int:
    """The Python function calls made while ``action()`` runs (``sys.setprofile``): the same
    from run to run, unlike a time."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls[0]


class Clock:
    """Times consecutive actions on one device, in seconds.

    On the CPU, the host clock. On a CUDA device, an event on the current stream after each
    action, and a synchronize only before the first action and after the last: inside the
    timed region the host runs ahead as it does in training, and each action's time is what
    it adds to the device's timeline (host work the device has to wait for included).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"no clock for device {str(device)!r}: use cpu or cuda")

    def times(self, *actions: Callable[[], object]) -> list[float]:
        """Run ``actions`` one after the other; the time each took."""
        if not self.cuda:
            marks = [time.perf_counter()]
            for action in actions:
                action()
                marks.append(time.perf_counter())
            return [b - a for a, b in zip(marks, marks[1:])]
        torch.cuda.synchronize(self.device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(actions) + 1)]
        stream = torch.cuda.current_stream(self.device)
        events[0].record(stream)
        for action, event in zip(actions, events[1:]):
            action()
            event.record(stream)
        torch.cuda.synchronize(self.device)
        return [1e-3 * a.elapsed_time(b) for a, b in zip(events, events[1:])]

    def time(self, action: Callable[[], object]) -> float:
        """The time ``action`` took."""
        return self.times(action)[0]

    def name(self) -> str:
        """The device in words: ``cpu (2 threads)`` or the GPU's name."""
        if self.cuda:
            return torch.cuda.get_device_name(self.device)
        return f"cpu ({torch.get_num_threads()} threads)"


class HookSpans:
    """The time the inspector's own optimizer step hooks take, as the clock times: a pre-hook
    and a post-hook of this object's registered before the inspector's (:meth:`__init__`, before
    ``Inspector.start()``) and another of each after them (:meth:`after_inspector`) mark where
    they begin and end. :meth:`take` is the time between the marks since the last call."""

    def __init__(self, opt: torch.optim.Optimizer, clock: Clock) -> None:
        self._clock, self._opt = clock, opt
        self._marks: dict[str, object] = {}
        self._handles = [opt.register_step_pre_hook(self._mark("pre0")), opt.register_step_post_hook(self._mark("post0"))]

    def after_inspector(self) -> None:
        opt = self._opt
        self._handles += [opt.register_step_pre_hook(self._mark("pre1")), opt.register_step_post_hook(self._mark("post1"))]

    def _mark(self, key: str) -> Callable[..., None]:
        def mark(*_: object) -> None:
            if self._clock.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(self._clock.device))
                self._marks[key] = event
            else:
                self._marks[key] = time.perf_counter()
        return mark

    def take(self) -> float:
        """Seconds inside the inspector's hooks during the last optimizer step (0 without one)."""
        marks, self._marks = self._marks, {}
        if len(marks) < 4:
            return 0.0
        if self._clock.cuda:
            torch.cuda.synchronize(self._clock.device)
            return 1e-3 * (marks["pre0"].elapsed_time(marks["pre1"]) + marks["post0"].elapsed_time(marks["post1"]))
        return (marks["pre1"] - marks["pre0"]) + (marks["post1"] - marks["post0"])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
