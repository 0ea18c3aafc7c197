"""How the traced probe's histogram is counted inside compiled code: the options, timed.

    python benchmarks/traced_histogram.py [--device cuda] [--calls 50]

Each option is one compiled function (Inductor) of a module's output, the way the traced probe
runs it in the graph: the statistics (exact, every value) and 32 bucket counts. Times are the
median over ``--calls`` calls after the compile, for outputs of 64 K, 1 M and 4 M values, with
the statistics alone as the floor:

    stats only      count, NaN/Inf, min, max, sum, sum of squares: no histogram
    compare/all     every value compared with every bucket (``(q == j).sum()``): one fused reduction
    compare/sample  the same over a strided sample of at most 16,384 values plus the extremes,
                    scaled to the finite count (what ``stats.traced_row`` does)
    scatter/all     ``bucketize``-style indices, then ``scatter_add_`` of ones (what the eager
                    reference ``stats._reduce_generic`` does)
    scatter/sample  the same over the sample

The first column is each option's cost over the statistics alone, in microseconds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Clock  # noqa: E402

from layerwatch import stats as S  # noqa: E402

BINS = 32


def head(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    finite = torch.isfinite(t)
    x = torch.where(finite, t, torch.zeros((), dtype=t.dtype, device=t.device))
    inf = torch.full((), math.inf, dtype=t.dtype, device=t.device)
    mn, mx = torch.where(finite, t, inf).amin(), torch.where(finite, t, -inf).amax()
    return finite.sum(), t.numel() - finite.sum(), mn, mx, x.sum(), (x * x).sum()


def counts(values: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, how: str) -> torch.Tensor:
    scale, anchor, zero_point = S.grid(mn, mx, BINS)
    finite = torch.isfinite(values)
    q = torch.floor((torch.where(finite, values, torch.zeros_like(values)) - anchor) / scale + 0.5) + zero_point
    q = torch.where(finite, q.clamp(0, BINS + 1), torch.full_like(q, BINS + 2))
    if how == "compare":
        return (q.unsqueeze(-1) == torch.arange(BINS + 3, device=q.device, dtype=q.dtype)).sum(0)
    index = q.long()
    return torch.zeros(BINS + 3, dtype=torch.int64, device=q.device).scatter_add_(0, index, torch.ones_like(index))


def option(how: str, sample: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def row(t: torch.Tensor) -> torch.Tensor:
        h = head(t)
        parts = [torch.stack([v.to(torch.float64) for v in h])]
        if how:
            values = t
            if sample and t.numel() > S.HISTOGRAM_VALUES:
                values = torch.cat([t[:: S.prime_stride(t.numel(), S.HISTOGRAM_VALUES)], torch.stack([h[2], h[3]])])
            parts.append(counts(values, h[2], h[3], how).to(torch.float64))
        return torch.cat(parts)

    return torch.compile(row, dynamic=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    clock = Clock(args.device)
    options = {"stats only": ("", False), "compare/all": ("compare", False), "compare/sample": ("compare", True),
               "scatter/all": ("scatter", False), "scatter/sample": ("scatter", True)}
    print(f"torch {torch.__version__}, {clock.name()}; microseconds per output (median of {args.calls}), "
          "and over the statistics alone")
    print("| values | " + " | ".join(options) + " |")
    print("|---|" + "---|" * len(options))
    for n in (1 << 16, 1 << 20, 1 << 22):
        t = torch.randn(n, device=clock.device)
        times = {}
        for name, (how, sample) in options.items():
            fn = option(how, sample)
            fn(t)  # compile
            times[name] = 1e6 * statistics.median(clock.time(lambda: fn(t)) for _ in range(args.calls))
        floor = times["stats only"]
        cells = [f"{times[name]:.0f}" + ("" if name == "stats only" else f" (+{times[name] - floor:.0f})") for name in options]
        print(f"| {n:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
