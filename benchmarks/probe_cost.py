"""What one probed module costs: the per-module probes alone, on the benchmark workloads.

    python benchmarks/probe_cost.py [--workloads stack32,tfm-tiny,...] [--rounds 7] [--families latency,...]
                                    [--device cuda]

For each workload, rounds of: an uninstrumented step (base), then a step with a
``RuntimeProbe`` on every module (the hooks a sampled step arms; the layer table and the
parameter families are not included), its buffers and plans kept from round to round as the
inspector keeps them. Reported, medians over rounds:

    arm        registering the hooks (a forward pre-hook and a forward hook per module)
    step       the training step with the hooks, against base
    hooks      host time inside the hooks themselves (what the probe measures of itself)
    result     reducing the recorded outputs and reading everything back after the step
    per module (hooks + arm + result) / modules, and the whole added time / modules: the
               difference is torch's own slower path for a module that has hooks, the
               tensor hooks' calls from the autograd engine and the garbage collector

With ``--device cuda`` the times are CUDA events around each phase (``timing.Clock``); the
hooks' own time stays host time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Clock  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from layerwatch import stats as S  # noqa: E402
from layerwatch.probes import RuntimeProbe, select_modules  # noqa: E402
from layerwatch.vocabulary import PROBE_FAMILIES  # noqa: E402


def measure(name: str, rounds: int, families: tuple[str, ...], clock: Clock) -> dict:
    model, _, step = WORKLOADS[name](device=clock.device)
    for _ in range(3):
        step()
    parameters = list(model.parameters())
    modules = select_modules(model, None)
    times: dict[str, list[float]] = {"base": [], "arm": [], "step": [], "hooks": [], "result": []}
    workspace = S.Workspace()  # kept from one sampled step to the next, as the inspector keeps it
    probes: list[RuntimeProbe] = []

    def arm() -> None:
        probes.append(RuntimeProbe(modules, families=families, bins=32, zeros=False, centered=False,
                                   parameters=parameters, workspace=workspace))

    for _ in range(rounds):
        times["base"].append(clock.time(step))
        armed, stepped, read = clock.times(arm, step, lambda: probes[-1].result())
        times["arm"].append(armed)
        times["step"].append(stepped)
        times["result"].append(read)
        times["hooks"].append(probes.pop().hook_seconds)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    added = ms["arm"] + ms["step"] - ms["base"] + ms["result"]
    n = len(modules)
    return {"workload": name, "modules": n, **ms, "added": added,
            "own_us_per_module": 1e3 * (ms["hooks"] + ms["arm"] + ms["result"]) / n,
            "added_us_per_module": 1e3 * added / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="stack32,tfm-tiny,tfm,cnn,gpt")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--families", default=",".join(PROBE_FAMILIES))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (timed with CUDA events)")
    args = parser.parse_args()
    clock = Clock(args.device)
    print(f"torch {torch.__version__}, {clock.name()}, rounds={args.rounds}")
    print("| workload | modules | base step | arm | step with hooks | hooks' own time | result | added in all | own per module | added per module |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        r = measure(name, args.rounds, tuple(args.families.split(",")), clock)
        print(f"| {name} | {r['modules']} | {r['base']:.1f} ms | {r['arm']:.1f} ms | {r['step']:.1f} ms | {r['hooks']:.1f} ms "
              f"| {r['result']:.1f} ms | {r['added']:.1f} ms | {r['own_us_per_module']:.0f} us | {r['added_us_per_module']:.0f} us |",
              flush=True)


if __name__ == "__main__":
    main()
