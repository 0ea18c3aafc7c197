"""What the NaN sentinel costs the host on an unsampled step, piece by piece.

    python benchmarks/sentinel_host.py [--workloads tfm,cnn] [--device cuda] [--iters 200]

On a GPU the sentinel's kernels take the device microseconds; what an unsampled step pays is
the host's time to launch them (a GPU step whose host runs ahead of the device pays nothing
more; one whose host is the bottleneck pays all of it). Each piece is timed on the host with
``perf_counter`` over ``--iters`` calls, the device idle before each call (a sync between
calls, not timed), on the gradients of a workload after one real step:

- check+poll: ``NonfiniteSentinel.check_next`` and ``poll()``, as the engine calls them;
- foreach_norm: the fused norm alone (``sentinel.fused_norms``);
- pinned_empty, copy_async, event_new, event_record, event_query: the pieces of the copy to
  the host;
- off_step: a whole unsampled ``Inspector.step()`` with the sentinel, and without it.

Medians, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # noqa: E402

from layerwatch import Inspector  # noqa: E402
from layerwatch.faults.sentinel import NonfiniteSentinel
from layerwatch.stats.norms import fused_norms  # noqa: E402


def host_us(action: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    """The median host time of ``action``, in microseconds, the device idle before each call."""
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    sync()
    return 1e6 * statistics.median(times)


def pieces(workload: str, device: str, iters: int) -> dict[str, float]:
    model, opt, step = WORKLOADS[workload](device=device)
    step()
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    grads = [p.grad for _, p in params]
    sentinel = NonfiniteSentinel()
    sentinel.watch(params, lambda t: t)
    counter = iter(range(10**9))

    def check_and_poll() -> None:
        sentinel.check_next(next(counter), True)
        sentinel.poll()

    out = {"tensors": len(grads), "check+poll": host_us(check_and_poll, iters, sync),
           "foreach_norm": host_us(lambda: fused_norms(grads), iters, sync)}
    peaks = fused_norms(grads)[0][1]
    if cuda:
        pinned = torch.empty(peaks.shape, dtype=peaks.dtype, pin_memory=True)
        event = torch.cuda.Event()
        out["pinned_empty"] = host_us(lambda: torch.empty(peaks.shape, dtype=peaks.dtype, pin_memory=True), iters, sync)
        out["copy_async"] = host_us(lambda: pinned.copy_(peaks, non_blocking=True), iters, sync)
        out["event_new"] = host_us(torch.cuda.Event, iters, sync)
        out["event_record"] = host_us(event.record, iters, sync)
        out["event_query"] = host_us(event.query, iters, sync)
    for sentinel_on in (True, False):
        with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Inspector(model, log_dir=log_dir, every_n_steps=10**6, optimizer=opt, sentinel=sentinel_on) as inspector:
                for _ in range(3):  # step 0 is sampled; then every step is off
                    step()
                    inspector.step()
                times = []
                for _ in range(iters // 4 or 1):
                    step()
                    sync()
                    start = time.perf_counter()
                    inspector.step()
                    times.append(time.perf_counter() - start)
        out["off_step" if sentinel_on else "off_step_no_sentinel"] = 1e6 * statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="tfm,cnn")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}; host time per call, median us")
    for workload in args.workloads.split(","):
        row = pieces(workload, args.device, args.iters)
        print(workload, "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
