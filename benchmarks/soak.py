"""A long run with the inspector on: is memory flat, is a sampled step's time flat, and how
many bytes does each sample add to the event file?

    python benchmarks/soak.py [--steps 20000] [--every 10] [--window 1000]

Trains a small MLP (8 parameter tensors) on generated data with the default Inspector
(histograms, norms, NaN counts, alerts, the layer table once), sampled every ``--every``
steps. Every ``--window`` steps it prints the resident memory (VmRSS), the median time of
a sampled and of an unsampled step in that window, and the event-file bytes written per
sample in it. At the end: RSS growth after warm-up (the first two windows), and a
projection of the event file for a month at one sample a minute.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from layerwatch import Inspector


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def event_bytes(log_dir: Path) -> int:
    return sum(f.stat().st_size for f in log_dir.glob("events.out.tfevents.*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--window", type=int, default=1_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    centres = torch.randn(10, 64)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps, sampled every {args.every}")
    print("| steps | RSS MiB | sampled step ms | off step ms | bytes per sample |")
    print("|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        with Inspector(model, log_dir=log_dir, every_n_steps=args.every, optimizer=opt) as inspector:
            sampled, off, bytes_at_start = [], [], event_bytes(log_dir)
            for k in range(args.steps):
                started = time.perf_counter()
                y = torch.randint(0, 10, (64,))
                x = centres[y] + torch.randn(64, 64)
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                inspector.step()
                (sampled if k % args.every == 0 else off).append(time.perf_counter() - started)
                if (k + 1) % args.window == 0:
                    written = event_bytes(log_dir)
                    row = (k + 1, rss_mib(), 1e3 * statistics.median(sampled), 1e3 * statistics.median(off),
                           (written - bytes_at_start) / len(sampled))
                    rows.append(row)
                    print("| {} | {:.1f} | {:.2f} | {:.3f} | {:.0f} |".format(*row), flush=True)
                    sampled, off, bytes_at_start = [], [], written
    warm = rows[min(1, len(rows) - 1)]
    print(f"\nRSS growth after warm-up (step {warm[0]} to {rows[-1][0]}): {rows[-1][1] - warm[1]:+.1f} MiB")
    per_sample = statistics.median(r[4] for r in rows[1:] or rows)
    print(f"event file: {per_sample:.0f} bytes per sample; a month at one sample a minute: "
          f"{per_sample * 60 * 24 * 30 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
