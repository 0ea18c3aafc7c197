"""How long ``layerwatch report`` takes on a long run's log.

    python benchmarks/report_speed.py [--samples 20000] [--logdir DIR]

Writes a log of ``--samples`` sampled steps (a 10-layer MLP, 20 tensors, sampled on every
step with the default families: histograms included), unless ``--logdir`` already holds one,
then times ``build_report`` on it, and reading the same files with TensorBoard's own
``EventFileLoader`` for comparison.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from layerwatch import Inspector
from layerwatch.reading.report import build_report, find_runs


def write_log(log_dir: Path, samples: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Inspector(model, log_dir=log_dir, every_n_steps=1) as inspector:
        for _ in range(samples):
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            inspector.step()
            opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--logdir", default=None, help="reuse (or create) the log here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(args.logdir or tmp)
        if not list(log_dir.rglob("*tfevents*")):
            started = time.perf_counter()
            write_log(log_dir, args.samples)
            print(f"wrote {args.samples} samples in {time.perf_counter() - started:.0f} s")
        size = sum(f.stat().st_size for f in log_dir.rglob("*tfevents*"))
        started = time.perf_counter()
        report = build_report(log_dir)
        ours = time.perf_counter() - started
        samples = sum(run["steps"]["samples"] for run in report["runs"] if run["steps"])
        print(f"layerwatch report: {samples} samples, {size / 2**20:.0f} MiB, {ours:.1f} s")
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        started = time.perf_counter()
        for files in find_runs(log_dir).values():
            for path in files:
                for _ in EventFileLoader(str(path)).Load():
                    pass
        print(f"TensorBoard's EventFileLoader, reading the same files: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
