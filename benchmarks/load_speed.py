"""How long ``layerwatch.load`` takes on a large run.

    python benchmarks/load_speed.py [--shapes 1000x500,100x5000] [--rounds 3] [--histograms]

For each ``LAYERSxSAMPLES`` shape, writes a synthetic run at the default options (each layer a
Linear weight: the weights' and gradients' default statistics and 32-bucket histograms,
update ratios, and the per-module ``fwd_ms``, ``bwd_ms``, ``activation_bytes``,
``saved_bytes`` and ``nonfinite``; cards, histograms and the LAYERWATCH tab's data as the
TensorBoard sink writes them), then times, in this process, the first call of ``load`` (it pays
pandas' import) and medians of ``--rounds`` calls: ``load`` (every value, one row each) and
``load_alerts``; with ``--histograms``, one call of ``load_histograms`` (it parses every record:
tens of seconds, and gigabytes, on the large shapes). The target: a run of 1,000 layers x 500
sampled steps loads in under 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def write_run(log_dir: Path, layers: int, samples: int) -> None:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from layerwatch import record as R
    from layerwatch import stats as S
    from layerwatch.options import validate_options
    from layerwatch.sinks.tensorboard import TensorBoardSink

    options = validate_options()
    torch.manual_seed(0)
    modules = [f"blocks.{i // 4}.{('attn', 'norm', 'mlp.fc1', 'mlp.fc2')[i % 4]}" for i in range(layers)]
    params = [f"{m}.weight" for m in modules]
    tensors = [torch.randn(256) * (1 + i % 7) for i in range(layers)]
    rows = S.to_host([S.reduce(tensors, options.bins, zeros=options.zeros, centered=options.centered)])[0]
    rows = rows.reshape(layers, -1)
    deltas, norms = np.full(layers, 0.01), np.ones(layers)
    rng = np.random.default_rng(0)
    sink = TensorBoardSink(SummaryWriter(str(log_dir)), owns_writer=True)
    for k in range(samples):
        rec = R.build(10 * k, {"weights": [(params, rows)], "grads": [(params, rows)], "update": [(params, (deltas, norms))]},
                      stats=options.stats, bins=options.bins, overhead_ms=1.0)
        times = rng.lognormal(-3, 1, layers)
        for name, ms in zip(modules, times.tolist()):  # the per-module families, as the probes' record has them
            rec.scalars[f"fwd_ms/{name}"] = ms
            rec.scalars[f"bwd_ms/{name}"] = 2 * ms
            rec.scalars[f"activation_bytes/{name}"] = 4096.0
            rec.scalars[f"saved_bytes/{name}"] = 2048.0
            rec.scalars[f"nonfinite/{name}"] = 0.0
        sink.write(rec)
    sink.close()


def timed(action, rounds: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(rounds):
        started = time.perf_counter()
        result = action()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1000x500,100x5000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--histograms", action="store_true", help="time load_histograms too")
    args = parser.parse_args()
    import layerwatch

    print("| layers x samples | event files | load: rows, first call s, median s | load_alerts s | load_histograms: rows, s |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        layers, samples = (int(n) for n in shape.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            write_run(Path(tmp), layers, samples)
            size = sum(f.stat().st_size for f in Path(tmp).rglob("*tfevents*"))
            first_s, frame = timed(lambda: layerwatch.load(tmp), 1)
            load_s, frame = timed(lambda: layerwatch.load(tmp), args.rounds)
            alerts_s, _ = timed(lambda: layerwatch.load_alerts(tmp), args.rounds)
            histograms = "not timed"
            if args.histograms:
                hist_s, hist = timed(lambda: layerwatch.load_histograms(tmp), 1)
                histograms = f"{len(hist):,}, {hist_s:.1f} s"
            print(f"| {layers:,} x {samples:,} | {size / 2**20:,.0f} MiB | {len(frame):,}, {first_s:.2f} s, {load_s:.2f} s | "
                  f"{alerts_s:.2f} s | {histograms} |", flush=True)


if __name__ == "__main__":
    main()
