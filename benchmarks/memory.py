"""What a sampled step adds to the peak memory of a training step, family by family.

    python benchmarks/memory.py [--workloads tfm-tiny,cnn,tfm] [--device cuda] [--compile [BACKEND]] [--json]

For each workload and each family (and every family together, ``defaults``), the model
trains ``WARM`` uninstrumented steps, then ``SAMPLED`` steps under
``Inspector(model, optimizer=opt, every_n_steps=1, families=(family,), sentinel=False)``
(``defaults``: every family and the sentinel), each a sampled step. Reported:

- peak added: the sampled steps' peak over the uninstrumented steps' peak. On the CPU that
  is the process's peak RSS (``ru_maxrss``), so each case runs in a process of its own; on a
  GPU, ``torch.cuda.max_memory_allocated``, reset before each phase. It is what raises the
  memory a run needs: what layerwatch allocates while the step's own activations are freed
  (the snapshot is taken after the backward) adds less than its size, or nothing.
- held after: memory still held after the last sample, over what was held before the first
  (CPU: current RSS; GPU: ``memory_allocated``): workspaces kept for the next sample.

With ``--compile`` each model is compiled in place (``model.compile()``) before its warm-up
steps, which compile it; then the peak of the tensors alive at once over two unsampled steps is
the baseline, and over two sampled steps the peak, each above what was alive as it began (on the
CPU from the profiler's record of torch's allocator, Inductor's kernels included; on a GPU from
the allocator's counters): the compile's own memory, which is not the step's, left out. "held
after" is then what the sampled steps left allocated (workspaces kept for the next sample). A
compiled model's sampled step adds its eager, forward-only re-run (``layerwatch/engine/rerun.py``).
- params: the parameters' bytes, the scale of a snapshot (100% of them).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # noqa: E402

from layerwatch import Inspector  # noqa: E402
from layerwatch.vocabulary import FAMILIES  # noqa: E402

WARM = 3
SAMPLED = 2
CASES = FAMILIES + ("defaults",)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _held_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_bytes()


def _live_peak(run: Callable[[], None], device: torch.device, window: str = "") -> tuple[int, int, int]:
    """The most bytes of tensors allocated by ``run()`` and alive at once, those still alive at its
    end, and the most that the last span ``run`` marked ``window`` (``torch.profiler.record_function``)
    added above what was alive as it began: on the CPU from the profiler's record of every
    allocation and free of torch's allocator (Inductor's kernels' too), summed in time order; on a
    GPU from the allocator's counters (no window)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start, torch.cuda.memory_allocated(device) - start, 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = prof.profiler.kineto_results.events()  # every allocation and free, as it happened
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    spans = sorted((e.start_ns(), e.end_ns()) for e in events if window and e.name() == window)
    live = peak = 0
    start: dict[tuple, int] = {}
    added = {span: 0 for span in spans}
    for time, change in changes:
        inside = [span for span in spans if span[0] <= time <= span[1]]
        for span in inside:
            start.setdefault(span, live)
        live += change
        peak = max(peak, live)
        for span in inside:
            added[span] = max(added[span], live - start[span])
    return peak, live, added[spans[-1]] if spans else 0  # the last span's: workspaces made at the first are kept


def measure(workload: str, case: str, device: str = "cpu", compiled: Optional[str] = None) -> dict[str, Any]:
    """One case in this process (on the CPU, a fresh one: the peak RSS never goes down). With
    ``compiled`` (a backend): see :func:`measure_compiled`."""
    if compiled is not None:
        return measure_compiled(workload, case, device, compiled)
    dev = torch.device(device)
    model, opt, step = WORKLOADS[workload](seed=0, device=device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(WARM):
        step()
    base_peak, held_before = _peak_bytes(dev), _held_bytes(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    options: dict[str, Any] = {} if case == "defaults" else {"families": (case,), "sentinel": False}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=tmp, optimizer=opt, every_n_steps=1, **options) as inspector:
            for _ in range(SAMPLED):
                step()
                inspector.step()
            peak, held_after = _peak_bytes(dev), _held_bytes(dev)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"workload": workload, "case": case, "device": device, "params_bytes": params,
            "peak_added_bytes": max(peak - base_peak, 0), "held_after_bytes": held_after - held_before}


def measure_compiled(workload: str, case: str, device: str, backend: str) -> dict[str, Any]:
    """The model compiled in place (``model.compile(backend=...)``), its warm-up steps compiling it;
    then ``SAMPLED`` unsampled steps and as many sampled ones, each phase's peak of the tensors
    alive at once (:func:`_live_peak`, above what was alive when it began): what a sampled step
    adds to the step's own peak, the compile left out (its memory is not the step's)."""
    dev = torch.device(device)
    model, opt, step = WORKLOADS[workload](seed=0, device=device)
    model.compile(backend=backend)
    for _ in range(WARM):
        step()

    def steps(inspector: Optional[Inspector] = None) -> None:
        for _ in range(SAMPLED):
            step()
            if inspector is not None:
                inspector.step()

    base_peak, _, _ = _live_peak(steps, dev)
    options: dict[str, Any] = {} if case == "defaults" else {"families": (case,), "sentinel": False}
    try:
        from layerwatch.engine import rerun
    except ImportError:  # a layerwatch from before the re-run (1c2410a: hooks compiled into the graph)
        rerun = None
    run_forward_again = None if rerun is None else rerun.run_forward_again

    def marked(*args: Any, **kwargs: Any) -> None:  # the re-run's span, for its own peak
        with torch.profiler.record_function("layerwatch.engine.rerun"):
            run_forward_again(*args, **kwargs)

    if rerun is not None:
        rerun.run_forward_again = marked
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Inspector(model, log_dir=tmp, optimizer=opt, every_n_steps=1, **options) as inspector:
                peak, held_after, rerun_peak = _live_peak(lambda: steps(inspector), dev, window="layerwatch.engine.rerun")
    finally:
        if rerun is not None:
            rerun.run_forward_again = run_forward_again
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"workload": f"{workload} (compiled)", "case": case, "device": device, "params_bytes": params,
            "peak_added_bytes": max(peak - base_peak, 0), "held_after_bytes": held_after, "step_peak_bytes": base_peak,
            "rerun_peak_bytes": rerun_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="tfm-tiny,cnn,tfm")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="compile each model in place (model.compile(), Inductor unless a backend is named)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, device=args.device, compiled=args.compile)))
        return
    rows = []
    for workload in args.workloads.split(","):
        for case in args.cases.split(","):
            if args.device == "cpu":  # a process per case: its peak RSS is its own
                compile_args = [] if args.compile is None else ["--compile", args.compile]
                out = subprocess.run([sys.executable, __file__, "--one", workload, case, *compile_args], check=True,
                                     capture_output=True, text=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
            else:
                row = measure(workload, case, args.device, args.compile)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        mib = 2 ** 20
        print(f"device: {args.device} ({'peak RSS' if args.device == 'cpu' else 'max_memory_allocated'})\n")
        print("| workload | family | params | peak added | peak added / params | held after |"
              + (" step's own peak | re-run's own peak |" if args.compile else ""))
        print("|---|---|---|---|---|---|" + ("---|---|" if args.compile else ""))
        for r in rows:
            print(f"| {r['workload']} | {r['case']} | {r['params_bytes'] / mib:.1f} MiB | "
                  f"{r['peak_added_bytes'] / mib:.1f} MiB | {r['peak_added_bytes'] / r['params_bytes']:.0%} | "
                  f"{r['held_after_bytes'] / mib:.1f} MiB |"
                  + (f" {r['step_peak_bytes'] / mib:.1f} MiB | {r['rerun_peak_bytes'] / mib:.1f} MiB |" if args.compile else ""))


if __name__ == "__main__":
    main()
