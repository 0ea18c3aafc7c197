"""Overhead of the Inspector, as ratios to an uninstrumented step measured in the same process.

    python benchmarks/overhead.py [--workloads gpt,cnn,stack] [--rounds 15] [--naive-rounds 3] [--optimizer]
                                  [--families weights,grads,...] [--no-sentinel]

By default every family is on (the parameter families, the layer table, and the
per-module probes: latency, memory, activations, nonfinite) and so is the NaN sentinel,
whose fused check runs in every off-step's ``inspector.step()`` call.

Each round runs, on the same model: an uninstrumented step (base); a step the inspector
does not sample (off), a step it samples (sampled) and the off-step right after it
(after), in that order; and a step followed by reading every parameter and gradient
once (``torch._foreach_norm``). An untimed step opens each round, and the three blocks
rotate from round to round so that no condition always runs in the same position. The
inspector's schedule samples every third inspector step, so base steps never see it.
The naive approach (``SummaryWriter.add_histogram`` on every parameter and gradient) is
timed in rounds of its own afterwards, so its after-effects never land on a base step.

Each condition's ratio is the median over rounds of its time divided by the same
round's base time (pairing neighbouring steps cancels slow drift of the machine).
"amortized@50" is ``(sampled + after + 48 * off) / 50``. "first sampled" is the first
sampled step alone: it also records the layer table (hooks on every module and
FlopCounterMode over the forward), once per run. The step after a sample is
counted as it is: memory released while writing a sample would show up there as page
faults. For the off term, the time of the ``inspector.step()`` call itself is measured
directly and added to base, because the only difference between an off-step and a base
step (microseconds) is far below the ~1% noise of comparing two whole steps; the paired
off-step ratio is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # noqa: E402

from layerwatch import Inspector  # noqa: E402
from layerwatch.record import FAMILIES  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def event_bytes(log_dir: str) -> tuple[int, int, float]:
    """(file bytes, sampled steps written, mean serialized bytes per histogram value)."""
    files = list(Path(log_dir).glob("events.out.tfevents.*"))
    steps, histo_sizes = set(), []
    for f in files:
        for event in LegacyEventFileLoader(str(f)).Load():
            for value in event.summary.value:
                if value.HasField("histo"):
                    steps.add(event.step)
                    histo_sizes.append(value.ByteSize())
    size = sum(f.stat().st_size for f in files)
    return size, len(steps), statistics.mean(histo_sizes) if histo_sizes else 0.0


def run(name: str, rounds: int, naive_rounds: int, with_optimizer: bool, families: tuple, sentinel: bool) -> dict:
    model, opt, step = WORKLOADS[name]()
    params = [p for p in model.parameters()]
    for _ in range(2):
        step()
    times: dict[str, list[float]] = {
        "base": [], "off": [], "off_call": [], "sampled": [], "after": [], "naive": [], "read_once": []
    }
    with tempfile.TemporaryDirectory() as tmp:
        inspector = Inspector(
            model,
            log_dir=f"{tmp}/lw",
            schedule=lambda k: k % 3 == 1,
            optimizer=opt if with_optimizer else None,
            families=families,
            sentinel=sentinel,
        )
        naive_writer = SummaryWriter(f"{tmp}/naive")
        with inspector:
            empty_size = event_bytes(f"{tmp}/lw")[0]
            def base() -> None:
                times["base"].append(timed(step))

            def inspected() -> None:
                start = time.perf_counter()
                step()
                call_start = time.perf_counter()
                inspector.step()
                end = time.perf_counter()
                times["off"].append(end - start)
                times["off_call"].append(end - call_start)
                times["sampled"].append(timed(lambda: (step(), inspector.step())))
                times["after"].append(timed(lambda: (step(), inspector.step())))

            def read_once() -> None:
                times["read_once"].append(timed(lambda: (step(), torch._foreach_norm(params + [p.grad for p in params]))))

            blocks = [base, inspected, read_once]
            for r in range(rounds):
                step()  # untimed: absorbs any after-effect of the previous round
                for block in blocks[r % 3 :] + blocks[: r % 3]:  # rotate: no condition owns a position
                    block()
        for r in range(naive_rounds):
            def naive() -> None:
                step()
                for pname, p in model.named_parameters():
                    naive_writer.add_histogram(f"weights/{pname}", p, r)
                    naive_writer.add_histogram(f"grads/{pname}", p.grad, r)
                naive_writer.flush()

            step()
            times["naive"].append(timed(naive))
        naive_writer.close()
        size, sampled_steps, per_histogram = event_bytes(f"{tmp}/lw")
    base = times["base"]
    ratio = {k: statistics.median(t / base[i % len(base)] for i, t in enumerate(v)) for k, v in times.items() if v}
    off_direct = 1 + statistics.median(times["off_call"]) / statistics.median(base)
    return {
        "workload": name,
        "optimizer": with_optimizer,
        "families": ",".join(families),
        "sentinel": sentinel,
        "tensors": len(params),
        "params": sum(p.numel() for p in params),
        "base_ms": 1e3 * statistics.median(base),
        "sampled": ratio["sampled"],
        "first_sampled": times["sampled"][0] / statistics.median(base),  # also records the layer table
        "off": ratio["off"],
        "after": ratio["after"],
        "off_call_us": 1e6 * statistics.median(times["off_call"]),
        "amortized@50": (ratio["sampled"] + ratio["after"] + 48 * off_direct) / 50,
        "naive": ratio.get("naive"),
        "read_once": ratio["read_once"],
        "bytes_per_sampled_step": (size - empty_size) / max(sampled_steps, 1),
        "bytes_per_histogram": per_histogram,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="gpt,cnn,stack")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--naive-rounds", type=int, default=3)
    parser.add_argument("--optimizer", action="store_true", help="also measure with optimizer= (update ratios)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="families to log (default: all)")
    parser.add_argument("--no-sentinel", action="store_true", help="turn the every-step NaN sentinel off")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    families = tuple(args.families.split(","))
    results = []
    for name in args.workloads.split(","):
        for with_optimizer in (False, True) if args.optimizer else (False,):
            results.append(run(name, args.rounds, args.naive_rounds, with_optimizer, families, not args.no_sentinel))
            if args.json:
                print(json.dumps(results[-1]), flush=True)
    if args.json:
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, rounds={args.rounds}, "
          f"families={args.families}, sentinel={'off' if args.no_sentinel else 'on'}")
    print("| workload | optimizer= | tensors | base step | sampled | first sampled (+ layer table) | off-step | off-step call | after sample | amortized@50 | naive | read once | bytes/sampled step | bytes/histogram |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        naive = f"{r['naive']:.2f}x" if r["naive"] is not None else "-"
        print(
            f"| {r['workload']} | {'yes' if r['optimizer'] else 'no'} | {r['tensors']} | {r['base_ms']:.0f} ms "
            f"| {r['sampled']:.3f}x | {r['first_sampled']:.2f}x | {r['off']:.3f}x | {r['off_call_us']:.1f} us | {r['after']:.3f}x | {r['amortized@50']:.4f}x | {naive} | {r['read_once']:.3f}x "
            f"| {r['bytes_per_sampled_step'] / 1024:.0f} KiB | {r['bytes_per_histogram']:.0f} B |"
        )


if __name__ == "__main__":
    main()
