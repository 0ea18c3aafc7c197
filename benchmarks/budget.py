"""The overhead budget's amortized cost at the defaults: no schedule argument at all.

    python benchmarks/budget.py [--workloads gpt,cnn,tfm,stack32,tfm-tiny] [--budgets default,0.05]
                                [--steps 600] [--block 2] [--warmup 20] [--device cuda] [--json]

For each workload and budget, two copies of the model are built from the same seed: one
trained under ``Inspector(model, optimizer=opt)`` (``default``: no schedule argument, so the
1% overhead budget; a number: ``overhead_budget=`` that number), the other uninstrumented.

Two copies of one model do not run at quite the same speed (where their memory lies: this VM
showed the copies of tfm-tiny 2% apart, either way, more than the 1% being measured). So first
both copies run ``--calibrate`` steps each, uninstrumented, paired as below, and their ratio
(``calibration``) divides the final one.

The inspected copy first trains alone, as in a real run, until the budget has chosen its
interval and a later check has kept it (at least ``--warmup`` steps): its first
samples pay the one-off costs (plans, the layer table), and its own clock sees only its own
steps. The interval is then held (the pacer decides nothing more), because the base steps
interleaved from here on would enter the budget's clock: it reads the wall time between step
calls, which would now hold base steps too. Blocks of ``--block`` inspected steps then
alternate with blocks of as many base steps (which of the two comes first alternates too), in
one process, until at least ``--steps`` inspected steps have run and their number is a whole
multiple of the interval (so the window holds exactly as many samples as the interval gives).
The ratio is the inspected blocks' total time over the base blocks' total time: every
off-step, every sample and the sentinel, as a long run pays them. Short blocks pair
neighbouring steps, so the machine's drift cancels (this VM's step time moves by 10% within
minutes). On a GPU each block is timed with CUDA events (``timing.Clock``), which synchronize
at each block's end: pass ``--block 25`` there.

Columns: the interval the budget chose (and the ones it went through while warming up), the
steps it warmed up for, the steps and samples of the measured window, the base step, the two
copies' calibration ratio, and the amortized ratio (calibrated); the target at the default
budget is <= 1.01.
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


sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Clock  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from layerwatch import Inspector  # noqa: E402

INTERVAL_TAG = "layerwatch/sample_interval"


def paired(clock: Clock, first, second, total: int, block: int) -> tuple[float, float]:
    """``first(n)`` and ``second(n)`` in alternating blocks of ``block`` steps (which comes first
    alternates as well) until each ran ``total`` steps: their total times."""
    first_s = second_s = 0.0
    done = 0
    while done < total:
        n = min(block, total - done)
        if (done // block) % 2:  # the order alternates: a drift of the machine cancels out
            b, a = clock.times(lambda: second(n), lambda: first(n))
        else:
            a, b = clock.times(lambda: first(n), lambda: second(n))
        first_s, second_s, done = first_s + a, second_s + b, done + n
    return first_s, second_s


def run(workload: str, budget: Optional[float], *, steps: int = 600, block: int = 2, warmup: int = 20,
        calibrate: int = 200, device: str = "cpu") -> dict[str, Any]:
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

        def copy_block(n: int) -> None:
            for _ in range(n):
                step()

        copy_s, base_s = paired(clock, copy_block, base_block, calibrate, block)
        with inspector:
            pacer, chosen = inspector.schedule, None
            while chosen is None or pacer.interval != chosen:  # until a check past the first keeps it
                chosen = pacer.interval
                while inspector.current_step <= max(warmup, chosen or 1):
                    inspected_block(1)
            pacer.decide = lambda: None  # held: the base steps below would enter its clock
            base_block(warmup)
            first = inspector.current_step
            interval = pacer.interval
            total = max(steps, interval * math.ceil(steps / interval))
            inspected_s, measured_base_s = paired(clock, inspected_block, base_block, total, block)
    in_window = [s for s in intervals if first <= s < first + total]
    warmed = sorted({int(v) for s, v in intervals.items() if s < first})
    return {
        "workload": workload, "device": clock.name(), "budget": 0.01 if budget is None else budget,
        "interval": interval, "intervals": warmed, "warmup": first,
        "steps": total, "samples": len(in_window), "base_ms": 1e3 * measured_base_s / total,
        "calibration": copy_s / base_s, "amortized": inspected_s / measured_base_s / (copy_s / base_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt,cnn,tfm,stack32,tfm-tiny")
    parser.add_argument("--budgets", default="default,0.05", help="comma-separated: default or a number in (0, 1]")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--block", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--calibrate", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="one JSON object per run, as it finishes")
    args = parser.parse_args()
    rows = []
    for workload in args.workloads.split(","):
        for budget in args.budgets.split(","):
            r = run(workload, None if budget == "default" else float(budget), steps=args.steps, block=args.block,
                    warmup=args.warmup, calibrate=args.calibrate, device=args.device)
            rows.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
    if not args.json:
        print(f"device: {rows[0]['device']}\n")
        print("| workload | budget | interval (went through) | warm-up | steps | samples | base step | calibration "
              "| amortized |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['workload']} | {r['budget']:g} | {r['interval']} ({', '.join(map(str, r['intervals']))}) | "
                  f"{r['warmup']} | {r['steps']} | {r['samples']} | {r['base_ms']:.1f} ms | {r['calibration']:.4f} | "
                  f"{r['amortized']:.4f}x |")


if __name__ == "__main__":
    main()
