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
steps, which compile it; the baseline is then the peak of as many unsampled steps after them
(the CPU's high-water mark reset first, through Linux's ``/proc/self/clear_refs``), so that the
compile's own peak is not taken for the step's. A compiled model's sampled step adds its eager,
forward-only re-run (``layerwatch/rerun.py``).
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
from typing import Any, Optional

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


def _reset_peak(device: torch.device) -> None:
    """The peak from now on: CUDA's counter; on the CPU the process's high-water mark (Linux's
    ``clear_refs``), so that a compile's peak in the warm-up steps is not the baseline's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024


def measure(workload: str, case: str, device: str = "cpu", compiled: Optional[str] = None) -> dict[str, Any]:
    """One case in this process (on the CPU, a fresh one: the peak RSS never goes down). With
    ``compiled`` (a backend), the model is compiled in place first (``model.compile()``), and the
    baseline is the peak of unsampled steps after the warm-up ones (which compile)."""
    dev = torch.device(device)
    model, opt, step = WORKLOADS[workload](seed=0, device=device)
    cuda = dev.type == "cuda"
    if compiled is not None:
        model.compile(backend=compiled)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(WARM):
        step()
    if compiled is not None:  # the compile's peak is not the step's
        _reset_peak(dev)
        for _ in range(WARM):
            step()
        base_peak = torch.cuda.max_memory_allocated(dev) if cuda else _hwm_bytes()
        held_before = _held_bytes(dev)
        _reset_peak(dev)
    else:
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
            peak = _hwm_bytes() if compiled is not None and not cuda else _peak_bytes(dev)
            held_after = _held_bytes(dev)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"workload": workload + ("" if compiled is None else " (compiled)"), "case": case, "device": device,
            "params_bytes": params, "peak_added_bytes": max(peak - base_peak, 0), "held_after_bytes": held_after - held_before}


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
        print("| workload | family | params | peak added | peak added / params | held after |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['workload']} | {r['case']} | {r['params_bytes'] / mib:.1f} MiB | "
                  f"{r['peak_added_bytes'] / mib:.1f} MiB | {r['peak_added_bytes'] / r['params_bytes']:.0%} | "
                  f"{r['held_after_bytes'] / mib:.1f} MiB |")


if __name__ == "__main__":
    main()
