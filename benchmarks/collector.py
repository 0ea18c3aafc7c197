"""What the garbage collector costs the sampled steps, on one benchmark workload.

    python benchmarks/collector.py [stack32] [--samples 10] [--config defaults|wgu]

Trains the workload with ``Inspector(model, optimizer=opt)`` (or the weights + grads + updates
configuration) sampling every second step, and counts, over ``--samples`` samples after a
warm-up, the collections of each generation and the time they took (a ``gc.callbacks``
entry), with the objects alive in the process. The uninstrumented loop of every workload
makes no collection at all: these are the sampled steps' own.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # noqa: E402

from layerwatch import Inspector  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", nargs="?", default="stack32", choices=sorted(WORKLOADS))
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--config", default="defaults", choices=("defaults", "wgu"))
    args = parser.parse_args()
    model, opt, step = WORKLOADS[args.workload]()
    for _ in range(3):
        step()
    extra = {} if args.config == "defaults" else {"families": ("weights", "grads", "updates"), "sentinel": False}
    collections_by_generation: dict[int, list[float]] = collections.defaultdict(list)
    started = [0.0]

    def clock(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections_by_generation[info["generation"]].append(time.perf_counter() - started[0])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the alert rules' "too few samples" note
        with Inspector(model, optimizer=opt, log_dir=tempfile.mkdtemp(), every_n_steps=2, **extra) as inspector:
            for _ in range(8):  # warm-up: the layer table, the first samples
                step()
                inspector.step()
            gc.callbacks.append(clock)
            try:
                begun = time.perf_counter()
                for _ in range(2 * args.samples):
                    step()
                    inspector.step()
                elapsed = time.perf_counter() - begun
            finally:
                gc.callbacks.remove(clock)
    print(f"{args.workload}, {args.config}: {args.samples} samples in {2 * args.samples} steps, {elapsed:.2f} s; "
          f"{len(gc.get_objects()):,} objects in the process")
    for generation in (0, 1, 2):
        times = collections_by_generation.get(generation, [])
        print(f"generation {generation}: {len(times):4d} collections, {1e3 * sum(times):7.1f} ms")
    total = sum(sum(times) for times in collections_by_generation.values())
    print(f"per sample: {1e3 * total / args.samples:.1f} ms")


if __name__ == "__main__":
    main()
