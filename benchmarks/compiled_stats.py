"""Would a fused kernel pay? ``torch.compile`` of the statistics against the eager ops they replace.

    python benchmarks/compiled_stats.py [--device cuda]

Two measurements, each a median over calls after the compile (its time is printed too):

    rows      one chunk of the batched reduction, 780 x 1,280 values: each row's minimum,
              maximum, sum and norm, as four eager ops (what ``stats.reduce`` runs per chunk)
              and as one compiled function (Inductor fuses reductions over one input)
    update    the update ratio's difference norm over 2 M values: a subtraction into a
              buffer then ``vector_norm`` (the traffic of ``params.py``'s ``sub_`` into the
              snapshot then its norm), and one compiled ``((a - b) * (a - b)).sum()``

The first compile took 18 s here; Inductor's cache on disk makes later ones a few seconds.
Figures for this repository's 2-core CPU are in ``docs/performance.md``; on a GPU, where each
op is a launch, the gap may differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Clock  # noqa: E402


def median_us(action: Callable[[], object], clock: Clock, calls: int = 50) -> float:
    return 1e6 * statistics.median(clock.time(action) for _ in range(calls))


def compiled(fn: Callable, *args: torch.Tensor) -> tuple[Callable, float]:
    start = time.perf_counter()
    fn = torch.compile(fn, dynamic=False)
    fn(*args)
    return fn, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    clock = Clock(parser.parse_args().device)
    device = clock.device
    x = torch.randn(780, 1280, device=device)
    fused, rows_compile = compiled(lambda x: (x.amin(1), x.amax(1), x.sum(1), (x * x).sum(1)), x)
    eager = median_us(lambda: (x.amin(1), x.amax(1), x.sum(1), torch.linalg.vector_norm(x, dim=1)), clock)
    print(f"rows    eager {eager:8.1f} us   compiled {median_us(lambda: fused(x), clock):8.1f} us   (compile {rows_compile:.1f} s)")

    before = torch.randn(2_000_000, device=device)
    after = before + 1e-3 * torch.randn(2_000_000, device=device)
    scratch = torch.empty_like(before)
    diff, update_compile = compiled(lambda a, b: ((a - b) * (a - b)).sum(), after, before)
    sub_norm = median_us(lambda: (torch.sub(after, before, out=scratch), torch.linalg.vector_norm(scratch)), clock)
    fused_us = median_us(lambda: diff(after, before), clock)
    print(f"update  eager {sub_norm:8.1f} us   compiled {fused_us:8.1f} us   (compile {update_compile:.1f} s)")


if __name__ == "__main__":
    main()
