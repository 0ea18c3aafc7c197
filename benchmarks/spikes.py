"""What the loss spike check costs: between samples, with the detector on and off, and a capture.

    python benchmarks/spikes.py [--tensors 1000] [--workloads tfm-tiny,gpt] [--rounds 7] [--steps 60]

Two parts, each timed in one process:

- **The CPU proxy of the host-work bar** (``between_samples.py``'s chain of ``Linear(4, 4)``
  layers, N gradient tensors, where the host's work is all there is): the unsampled step with
  the detector on (``inspector.step(loss=...)``), on with a gradient norm as well
  (``grad_norm=``: a second scalar tensor handed over, what judging a norm the loop computed
  costs layerwatch; the step's loss stands in for it) and off (none given), at the defaults
  otherwise (the sentinel on). ``layerwatch us``: the host time layerwatch adds to the step
  (``inspector.step()`` and its optimizer hooks); ``unsampled / base``: the whole step over a
  copy of the model without layerwatch.
- **The workloads** (``workloads.py``: transformers by default), ``Inspector(model,
  optimizer=opt, every_n_steps=10**6)``: rounds of ``--steps`` unsampled steps with the loss
  given, without it, and of an uninstrumented copy, the three blocks rotating:
  ``unsampled / base``, the median step over the copy's. Then **a capture**: a spike is made at an unsampled step (the loss
  handed to ``step()`` there is the step's times 100; training is untouched), which samples
  that step at its end and the three after it: ``capture ms`` is what those four steps took
  beyond four median unsampled steps, ``capture / base step``: the same in base steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from between_samples import measure  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from layerwatch import Inspector  # noqa: E402

WARMUP = 40  # past the spike rule's warm-up (32 losses)


def workload(name: str, rounds: int, steps: int) -> dict[str, float]:
    model, opt, step = WORKLOADS[name]()
    _, _, plain = WORKLOADS[name]()  # a copy without layerwatch
    times: dict[str, list[float]] = {"on": [], "off": [], "base": []}

    def timed(what: str, run) -> None:
        for _ in range(steps):
            started = time.perf_counter()
            run()
            times[what].append(time.perf_counter() - started)

    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inspector = Inspector(model, log_dir=log_dir, optimizer=opt, every_n_steps=10**6).start()
        try:
            for _ in range(WARMUP):
                inspector.step(loss=step())
            blocks = [("on", lambda: inspector.step(loss=step())), ("off", lambda: (step(), inspector.step())),
                      ("base", plain)]
            for r in range(rounds):  # the blocks rotate: none always runs first
                for what, run in blocks[r % 3:] + blocks[: r % 3]:
                    timed(what, run)
            captured = []  # a capture: the spiking step, sampled at its end, and the three after it
            for k in range(4):
                started = time.perf_counter()
                loss = step()
                inspector.step(loss=loss * 100 if k == 0 else loss)
                captured.append(time.perf_counter() - started)
            assert len(inspector._engine._spikes.found) == 1, "the made spike was not found"
        finally:
            inspector.finish()
    base, unsampled = statistics.median(times["base"]), statistics.median(times["on"])
    extra = sum(captured) - 4 * unsampled
    return {"on": unsampled / base, "off": statistics.median(times["off"]) / base, "base_ms": 1e3 * base,
            "capture_ms": 1e3 * extra, "capture_steps": extra / base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", default="1000")
    parser.add_argument("--workloads", default="tfm-tiny,gpt")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; medians of {args.rounds} rounds")
    print("\nThe CPU proxy (chain of Linear(4, 4), SGD, 200 steps a round), sentinel on:")
    print("| gradient tensors | layerwatch us, loss | loss and norm | off | unsampled / base, loss | loss and norm | off |")
    print("|---|---|---|---|---|---|---|")
    for tensors in [int(n) for n in args.tensors.split(",") if n]:
        on = measure(tensors, True, args.rounds, 200, loss=True)
        both = measure(tensors, True, args.rounds, 200, loss=True, grad_norm=True)
        off = measure(tensors, True, args.rounds, 200, loss=False)
        print(f"| {tensors:,} | {on['own_us']:.0f} | {both['own_us']:.0f} | {off['own_us']:.0f} | {on['ratio']:.3f} | "
              f"{both['ratio']:.3f} | {off['ratio']:.3f} |")
    print(f"\nThe workloads ({args.steps} steps a round), at the defaults but a fixed schedule:")
    print("| workload | base step ms | unsampled / base, detector on | off | capture ms | capture / base step |")
    print("|---|---|---|---|---|---|")
    for name in [n for n in args.workloads.split(",") if n]:
        r = workload(name, args.rounds, args.steps)
        print(f"| {name} | {r['base_ms']:.1f} | {r['on']:.3f} | {r['off']:.3f} | {r['capture_ms']:.0f} | "
              f"{r['capture_steps']:.1f} |")


if __name__ == "__main__":
    main()
