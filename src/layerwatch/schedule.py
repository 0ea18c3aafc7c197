"""Which steps are sampled.

A schedule is a predicate over the step index: step ``k`` (the ``k``-th call of
``Inspector.step()``, counting from 0) is sampled when ``schedule(k)`` is true.
Everything here is plain Python, so deciding costs nothing on an off-step.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable, Union

import numpy as np

__all__ = ["Schedule", "every_n_steps", "at_steps", "windowed", "dense_then_every", "as_schedule"]


class Schedule:
    """A named predicate ``step -> bool`` with a readable ``repr``.

    Args:
        predicate: Called with the step index (``int >= 0``); returns whether it is sampled.
        description: What ``repr`` shows, e.g. ``"every_n_steps(50)"``.
    """

    __slots__ = ("_predicate", "_description")

    def __init__(self, predicate: Callable[[int], bool], description: str) -> None:
        self._predicate = predicate
        self._description = description

    def __call__(self, step: int) -> bool:
        """Whether ``step`` is sampled. Raises TypeError when the predicate returns anything but
        a bool (``None`` would otherwise silently never sample)."""
        result = self._predicate(step)
        if result is True or result is False:
            return result
        if isinstance(result, np.bool_):
            return bool(result)
        raise TypeError(f"schedule {self!r} must return a bool for a step; it returned {result!r} for step {step}")

    def __repr__(self) -> str:
        return self._description


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def every_n_steps(n: int) -> Schedule:
    """Sample step ``k`` when ``k % n == 0`` (steps 0, n, 2n, ...)."""
    _check_int("every_n_steps", n, 1)
    return Schedule(partial(_every, n), f"every_n_steps({n})")


def at_steps(steps: Iterable[int]) -> Schedule:
    """Sample exactly the listed steps."""
    chosen = frozenset(steps)
    for step in chosen:
        _check_int("each step in at_steps", step, 0)
    shown = sorted(chosen)
    return Schedule(chosen.__contains__, f"at_steps({shown[:8]}{'...' if len(shown) > 8 else ''})")


def windowed(*, wait: int, warmup: int = 0, active: int, repeat: int = 0, skip_first: int = 0) -> Schedule:
    """A cycle like ``torch.profiler.schedule``: skip ``wait + warmup`` steps, sample ``active``.

    After ``skip_first`` steps, cycles of ``wait + warmup + active`` steps repeat
    ``repeat`` times (0: forever). Warmup steps are not sampled; the parameter exists
    so a profiler schedule's numbers carry over unchanged.
    """
    _check_int("wait", wait, 0)
    _check_int("warmup", warmup, 0)
    _check_int("active", active, 1)
    _check_int("repeat", repeat, 0)
    _check_int("skip_first", skip_first, 0)
    return Schedule(
        partial(_windowed, wait + warmup, wait + warmup + active, repeat, skip_first),
        f"windowed(wait={wait}, warmup={warmup}, active={active}, repeat={repeat}, skip_first={skip_first})",
    )


def dense_then_every(first: int, every: int) -> Schedule:
    """Sample every step below ``first``, then every ``every``-th step: suits long runs."""
    _check_int("first", first, 0)
    _check_int("every", every, 1)
    return Schedule(partial(_dense_then_every, first, every), f"dense_then_every(first={first}, every={every})")


# Module-level predicates (bound with functools.partial) so schedules pickle: Lightning's
# ddp_spawn sends the Trainer's callbacks to each process.
def _every(n: int, k: int) -> bool:
    return k % n == 0


def _windowed(skipped: int, cycle: int, repeat: int, skip_first: int, k: int) -> bool:
    if k < skip_first:
        return False
    k -= skip_first
    if repeat and k // cycle >= repeat:
        return False
    return k % cycle >= skipped


def _dense_then_every(first: int, every: int, k: int) -> bool:
    return k < first or k % every == 0


ScheduleLike = Union[Schedule, int, Iterable[int], Callable[[int], bool]]


def as_schedule(value: ScheduleLike) -> Schedule:
    """Turn what a user passed as ``schedule=`` into a :class:`Schedule`.

    Accepts a :class:`Schedule`, an int (``every_n_steps``), an iterable of steps, or
    any callable ``step -> bool``.
    """
    if isinstance(value, Schedule):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return every_n_steps(value)
    if callable(value):
        return Schedule(value, f"callable({getattr(value, '__name__', type(value).__name__)})")
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return at_steps(value)
    raise TypeError(
        "schedule must be a Schedule, an int, an iterable of steps or a callable step -> bool, "
        f"got {value!r}"
    )
