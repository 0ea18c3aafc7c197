"""How long ``layerwatch.load`` takes on a large run.

    python benchmarks/load_speed.py [--shapes 1000x500,100x5000] [--rounds 3] [--histograms] [--keep DIR]

For each ``LAYERSxSAMPLES`` shape, writes a synthetic run at the default options (each layer a
Linear weight: the weights' and gradients' default statistics and 32-bucket histograms,
update ratios, and the per-module ``fwd_ms``, ``bwd_ms``, ``activation_bytes``,
``saved_bytes`` and ``nonfinite``; cards, histograms and the LAYERWATCH tab's data as the
TensorBoard sink writes them), then times, in this process, the first call of ``load`` (it pays
pandas' import) and medians of ``--rounds`` calls: ``load`` (every value, one row each) and
``load_alerts``. With ``--histograms``, one call of ``load_histograms`` for each of three cases
(:func:`histogram_cases`: every histogram, ten tensors at every step, every tensor at ten
steps), each in a fresh process so that its peak resident memory is its own: seconds, rows,
and the process's peak RSS before and after the call. ``--keep DIR`` writes each run once into
``DIR/LAYERSxSAMPLES`` and reads it from there on later calls. The target: a run of 1,000
layers x 500 sampled steps loads in under 2 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np


def write_run(log_dir: Path, layers: int, samples: int) -> None:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from layerwatch.sinks import record as R
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


def histogram_cases(samples: int) -> dict[str, dict[str, Any]]:
    """The ``load_histograms`` keyword arguments timed, by case: every histogram; ten weights
    chosen by one glob (``blocks.0`` to ``blocks.9``'s ``mlp.fc1.weight``: their weight and
    gradient histograms), at every step; every tensor at ten of the ``samples`` steps."""
    return {
        "every histogram": {},
        "10 tensors (one glob) x every step": {"tensors": "blocks.?.mlp.fc1.weight"},
        "every tensor x 10 steps": {"steps": range(0, 10 * samples, samples)},
    }


def measure_histograms(log_dir: str, samples: int, case: str) -> dict[str, float]:
    """One ``load_histograms`` call of ``case`` in this process: its seconds and rows, and the
    process's peak RSS (MiB) before it (imports done) and after it."""
    import pandas  # noqa: F401  (imported before the first reading of the peak, as are the protos)
    from tensorboard.compat.proto import event_pb2  # noqa: F401

    import layerwatch
    import layerwatch.reading.notebook  # noqa: F401

    before = peak_rss_mib()
    started = time.perf_counter()
    frame = layerwatch.load_histograms(log_dir, **histogram_cases(samples)[case])
    seconds = time.perf_counter() - started
    after = peak_rss_mib()
    return {"seconds": seconds, "rows": len(frame), "rss_before_mib": before, "rss_peak_mib": after}


def peak_rss_mib() -> float:
    """This process's peak resident memory, MiB: Linux's ``VmHWM``, which starts afresh with the
    process's image (``ru_maxrss`` keeps the parent's RSS at the fork, which can be larger)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def in_fresh_process(log_dir: Path, samples: int, case: str) -> str:
    """``case`` measured by :func:`measure_histograms` in a new interpreter, as a table cell."""
    done = subprocess.run([sys.executable, __file__, "--measure", str(log_dir), str(samples), case],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    m = json.loads(done.stdout.strip().splitlines()[-1])
    return (f"{m['rows']:,} rows, {m['seconds']:.2f} s, peak RSS {m['rss_peak_mib']:,.0f} MiB "
            f"(from {m['rss_before_mib']:,.0f})")


@contextlib.contextmanager
def run_dir(keep: str | None, layers: int, samples: int) -> Iterator[Path]:
    """A directory holding the synthetic run of this shape: in ``keep`` (written once), or a
    temporary one."""
    if keep is None:
        with tempfile.TemporaryDirectory() as tmp:
            write_run(Path(tmp), layers, samples)
            yield Path(tmp)
        return
    path = Path(keep) / f"{layers}x{samples}"
    if not any(path.glob("*tfevents*")):
        path.mkdir(parents=True, exist_ok=True)
        write_run(path, layers, samples)
    yield path


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
    parser.add_argument("--histograms", action="store_true",
                        help="time load_histograms too, each case in its own process")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="write the runs into DIR once, and read them from there")
    parser.add_argument("--measure", nargs=3, metavar=("LOGDIR", "SAMPLES", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        log_dir, samples, case = args.measure
        print(json.dumps(measure_histograms(log_dir, int(samples), case)))
        return
    import layerwatch

    print("| layers x samples | event files | load: rows, first call s, median s | load_alerts s |")
    print("|---|---|---|---|")
    histograms = []
    for shape in args.shapes.split(","):
        layers, samples = (int(n) for n in shape.split("x"))
        with run_dir(args.keep, layers, samples) as tmp:
            size = sum(f.stat().st_size for f in tmp.rglob("*tfevents*"))
            first_s, frame = timed(lambda: layerwatch.load(tmp), 1)
            load_s, frame = timed(lambda: layerwatch.load(tmp), args.rounds)
            alerts_s, _ = timed(lambda: layerwatch.load_alerts(tmp), args.rounds)
            print(f"| {layers:,} x {samples:,} | {size / 2**20:,.0f} MiB | {len(frame):,}, {first_s:.2f} s, {load_s:.2f} s | "
                  f"{alerts_s:.2f} s |", flush=True)
            if args.histograms:
                histograms += [(f"{layers:,} x {samples:,}", case, in_fresh_process(tmp, samples, case))
                               for case in histogram_cases(samples)]
    if histograms:
        print("\n| layers x samples | load_histograms of | rows, seconds, the process's peak RSS |\n|---|---|---|")
        for shape, case, cell in histograms:
            print(f"| {shape} | {case} | {cell} |")


if __name__ == "__main__":
    main()
