"""The timing the micro-benchmarks share."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(action: Callable[[], object], calls: int = 15) -> float:
    """The median of ``calls`` timed calls of ``action`` (after one untimed), in ms."""
    action()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
