"""The overhead budget's amortized cost at the defaults: no schedule argument at all.

    python benchmarks/budget.py [--workloads gpt,cnn,tfm,stack32,tfm-tiny] [--budgets default,0.05]
                                [--steps 600] [--block 50] [--warmup 20] [--device cuda] [--json]

For each workload and budget, two copies of the model are built from the same seed: one
trained under ``Inspector(model, optimizer=opt)`` (``default``: no schedule argument, so the
1% overhead budget; a number: ``overhead_budget=`` that number), the other uninstrumented.
The inspected copy first runs ``--warmup`` steps (its first samples, steps 0 and 1, choose
the interval there, and pay the one-off costs: plans, the layer table), and the base copy as
many. Then blocks of ``--block`` inspected steps alternate with blocks of ``--block`` base
steps, in one process, until at least ``--steps`` inspected steps have run and their number
is a whole multiple of the interval (so the window holds exactly as many samples as the
interval gives, wherever it starts). The ratio is the inspected blocks' total time over the
base blocks' total time: every off-step, every sample and the sentinel, as a long run pays
them. On a GPU each block is timed with CUDA events (``timing.Clock``).

Columns: the interval the budget chose (and the ones it went through), the samples in the
measured window, the base step, and the amortized ratio; the target at the default budget
is <= 1.01.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Clock  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from layerwatch import Inspector  # noqa: E402

INTERVAL_TAG = "layerwatch/sample_interval"


def run(workload: str, budget: Optional[float], *, steps: int = 600, block: int = 50, warmup: int = 20,
        device: str = "cpu") -> dict[str, Any]:
    """One workload at one budget (None: the default); see the module's docstring."""
    clock = Clock(device)
    model, opt, step = WORKLOADS[workload](seed=0, device=device)
    _, _, base_step = WORKLOADS[workload](seed=0, device=device)
    options = {} if budget is None else {"overhead_budget": budget}
    intervals: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trend alerts of a short run
        inspector = Inspector(model, log_dir=tmp, optimizer=opt, **options)
        inspector.add_sink(lambda record: intervals.__setitem__(record.step, record.scalars[INTERVAL_TAG]))

        def inspected_block(n: int) -> None:
            for _ in range(n):
                step()
                inspector.step()

        def base_block(n: int) -> None:
            for _ in range(n):
                base_step()

        with inspector:
            inspected_block(warmup)
            base_block(warmup)
            first = inspector.current_step
            interval = inspector.schedule.interval or 1
            total = max(steps, interval * math.ceil(steps / interval))
            inspected_s = base_s = 0.0
            done = 0
            while done < total:
                n = min(block, total - done)
                inspected, base = clock.times(lambda: inspected_block(n), lambda: base_block(n))
                inspected_s, base_s, done = inspected_s + inspected, base_s + base, done + n
            final = inspector.schedule.interval
    in_window = [s for s in intervals if first <= s < first + total]
    return {
        "workload": workload, "device": clock.name(), "budget": 0.01 if budget is None else budget,
        "interval": final, "intervals": sorted({int(v) for v in intervals.values()}), "warmup": warmup,
        "steps": total, "samples": len(in_window), "base_ms": 1e3 * base_s / total,
        "amortized": inspected_s / base_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt,cnn,tfm,stack32,tfm-tiny")
    parser.add_argument("--budgets", default="default,0.05", help="comma-separated: default or a number in (0, 1]")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="one JSON object per run, as it finishes")
    args = parser.parse_args()
    rows = []
    for workload in args.workloads.split(","):
        for budget in args.budgets.split(","):
            r = run(workload, None if budget == "default" else float(budget), steps=args.steps, block=args.block,
                    warmup=args.warmup, device=args.device)
            rows.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
    if not args.json:
        print(f"device: {rows[0]['device']}\n")
        print("| workload | budget | interval (went through) | steps | samples | base step | amortized |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['workload']} | {r['budget']:g} | {r['interval']} ({', '.join(map(str, r['intervals']))}) | "
                  f"{r['steps']} | {r['samples']} | {r['base_ms']:.1f} ms | {r['amortized']:.4f}x |")


if __name__ == "__main__":
    main()
