"""What making every step replayable costs, and what one replay costs.

    python benchmarks/replay.py [--workloads stack32,tfm-tiny,gpt] [--rounds 9] [--steps 10] [--device cuda]

Per workload (``workloads.py``), on one model, rounds of ``--steps`` training steps per
condition, the conditions' order rotating from round to round:

    base      no layerwatch
    sentinel  Inspector(model, optimizer=opt, alerts=False) sampling no step: the NaN
              sentinel's fused check of the gradients, read when it has landed (on a GPU a
              step later: the host never waits). What an unsampled step costs today.
    replay    the same, and ``inspector.replay_with(loss_fn)`` before each step's forward: the
              check is read before the optimizer step (on a GPU a device sync every step) and
              the RNG state is noted every step

Then the replay itself, once: the first Linear's output is made NaN (by a hook) for one replayable
step; its gradients go NaN, and the step's batch is run again with every probe armed
(one forward and one backward, and the model's state saved and put back). Printed as that
step's time over the median replay-ready step.

Times are per step, medians over rounds, in ms, with ``timing.Clock`` (CUDA events on a
GPU, with a synchronize only before and after each block of steps, so that inside a block
the host runs ahead of the device as in training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import warnings

import torch

from layerwatch import Inspector, at_steps
from timing import Clock
from workloads import WORKLOADS

NEVER = at_steps([10**9])


def run(name: str, rounds: int = 9, steps: int = 10, device: str = "cpu") -> dict:
    clock = Clock(device)
    model, opt, step = WORKLOADS[name](device=device)
    loss_fn = step.loss_fn
    log_dir = tempfile.mkdtemp()

    def block(condition: str) -> float:
        inspector = None
        if condition != "base":
            inspector = Inspector(model, log_dir=log_dir, schedule=NEVER, optimizer=opt, alerts=False).start()

        def steps_of_it() -> None:
            for _ in range(steps):
                if condition == "replay":
                    inspector.replay_with(loss_fn)
                step()

        step()  # untimed: the inspector's first check, the allocator warm
        seconds = clock.time(steps_of_it)
        if inspector is not None:
            inspector.finish()
        return 1e3 * seconds / steps

    conditions = ["base", "sentinel", "replay"]
    times: dict[str, list[float]] = {c: [] for c in conditions}
    for r in range(rounds):
        order = conditions[r % 3:] + conditions[:r % 3]
        for condition in order:
            times[condition].append(block(condition))
    ms = {c: statistics.median(t) for c, t in times.items()}

    fault = [False]  # the first Linear's output turns NaN while set (a hook, so the replay makes it again)
    first = next(m for m in model.modules() if type(m) is torch.nn.Linear)  # MultiheadAttention never calls its own
    first.register_forward_hook(lambda module, args, out: out * float("nan") if fault[0] else out)
    inspector = Inspector(model, log_dir=log_dir, schedule=NEVER, optimizer=opt).start()  # alerts: what it named
    step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sentinel's and the alert's
        fault[0] = True

        def faulty() -> None:
            inspector.replay_with(loss_fn)
            step()
            inspector.step()  # the replayed step is written

        replayed_ms = 1e3 * clock.time(faulty)
    named = [a.message for a in inspector.alerts if "(replayed from step" in a.message]
    inspector.finish()
    return {
        "workload": name, "device": clock.name(), **{f"{c}_ms": round(v, 3) for c, v in ms.items()},
        "sentinel_ratio": round(ms["sentinel"] / ms["base"], 3), "replay_ratio": round(ms["replay"] / ms["base"], 3),
        "replay_step_ms": round(replayed_ms, 3), "replay_step_ratio": round(replayed_ms / ms["replay"], 2),
        "replay_named": bool(named),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="stack32,tfm-tiny,gpt")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [run(w, args.rounds, args.steps, args.device) for w in args.workloads.split(",")]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"device: {results[0]['device']}")
    print(f"{'workload':10} {'base ms':>9} {'sentinel/base':>14} {'replay-ready/base':>18} {'replayed step/replay-ready':>27}")
    for r in results:
        print(f"{r['workload']:10} {r['base_ms']:9.3f} {r['sentinel_ratio']:14.3f} {r['replay_ratio']:18.3f} "
              f"{r['replay_step_ratio']:26.2f}x" + ("" if r["replay_named"] else "  (no module named)"))

if __name__ == "__main__":
    main()
