"""Overhead of the Inspector, as ratios to an uninstrumented step measured in the same process.

    python benchmarks/overhead.py [--workloads gpt,cnn,stack32,tfm,tfm-tiny] [--configs wgu,defaults]
                                  [--rounds 15] [--naive-rounds 0] [--wandb-rounds 3] [--json]
                                  [--families weights,grads,...] [--no-sentinel] [--device cuda]
                                  [--compile [BACKEND]]

With ``--compile`` each workload's model is compiled in place (``model.compile()``, Inductor
unless a backend is named) before its warm-up steps, so every ratio is to the compiled uninstrumented step; the per-module
families are then measured on an eager, forward-only re-run of each sampled step's batch
(``layerwatch/engine/rerun.py``), which compiles nothing: "first sampled" holds no compile.

With ``--device cuda`` the workloads train on the GPU and every time is taken with CUDA
events, with a synchronize only before and after each timed block (``timing.Clock``): inside
a block the host runs ahead of the device as it does in training, and a condition's time is
what it adds to the device's timeline.

Workloads are in ``workloads.py``. Each workload is measured once per configuration, each
on a freshly built model in the same process:

    wgu       Inspector(model, optimizer=opt, families=("weights", "grads", "updates"),
              sentinel=False): the parameter families only, no probes, no layer table
    defaults  Inspector(model, optimizer=opt): every default, i.e. every family (the
              parameter families, the layer table and the per-module probes: latency,
              memory, activations, nonfinite) and the NaN sentinel, whose fused check
              runs in every off-step's optimizer step pre-hook
    custom    Inspector(model, optimizer=opt, families=--families, sentinel=not --no-sentinel)
              (only when named in --configs)

Each round runs, on the same model: an uninstrumented step (base); four inspected steps
in a row: a pure off-step (off: neither it nor the next step is sampled), a step whose
``inspector.step()`` opens the sampled step (arming its hooks: that call is counted as
part of the sample), the sampled step (sampled), and the off-step right after it (after);
and a step followed by reading every parameter and gradient once
(``torch._foreach_norm``, the read-once floor). An untimed step opens each round, and the
three blocks rotate from round to round so that no condition always runs in the same
position. The inspector's schedule samples every fourth inspector step, so base steps
never see it. Comparisons that must not leave hooks or after-effects on a base
step run in rounds of their own after the inspector's (and after it is finished), each
an untimed step then a timed one: the naive approach (``SummaryWriter.add_histogram`` on
every parameter and gradient, ``--naive-rounds``, off by default) and, when ``import
wandb`` works, ``wandb.watch(model, log="all", log_freq=1)`` in offline mode
(``WANDB_MODE=offline``, ``wandb.init(dir=<tmp>)``) with a ``run.log`` per step so each
step's histograms are committed (``--wandb-rounds``). Install it with the ``bench`` extra.

Columns (ratios are the median over rounds of a condition's time divided by the same
round's base time; pairing neighbouring steps cancels slow drift of the machine; the
naive and wandb rounds are paired with the inspector rounds' base times by index):

    base step       median uninstrumented step
    sampled step    median sampled step (as below), ms
    sampled         a sampled step (step + ``inspector.step()``) plus the call that armed
                    it, ratio
    first sampled   the first sampled step alone over the median base step; under
                    "defaults" it also records the layer table (hooks on every module and
                    FlopCounterMode over the forward), once per run
    off-step        a pure off-step, paired ratio (its difference from base is often below
                    the ~1% noise of comparing two whole steps)
    off-step call   the time of the off-step's ``inspector.step()`` call itself, plus the time
                    inside the inspector's optimizer step hooks during its ``opt.step()``
                    (with the sentinel: its check of its share of the gradients, there)
    after sample    the off-step right after a sample, counted as it is: memory released
                    while writing a sample would show up there as page faults
    amortized@50    ``(sampled + after + 48 * off) / 50`` where the off term is base plus
                    the measured off-step call
    read once       the read-once floor: a step plus one ``_foreach_norm`` over every
                    parameter and gradient, ratio
    reported        median ``layerwatch/overhead_ms`` the inspector wrote to its event file,
                    over its sampled steps except the first (the layer-table one)
    delta           measured sampled-step delta: median sampled minus median base, ms
    rep/delta       reported / delta: how much of the measured cost the inspector sees
    wandb           ``wandb.watch(log="all", log_freq=1)`` step + ``run.log``, ratio;
                    "-" when wandb is not importable
    naive           the add_histogram step, ratio (only with --naive-rounds > 0)

``--json`` prints one JSON object per (workload, config) as it finishes (which also holds
the event-file bytes per sampled step and per histogram); otherwise a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Clock, HookSpans  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from layerwatch import Inspector  # noqa: E402
from layerwatch.vocabulary import FAMILIES  # noqa: E402

OVERHEAD_TAG = "layerwatch/overhead_ms"
WGU = ("weights", "grads", "updates")


def config_kwargs(config: str, families: tuple, sentinel: bool) -> dict[str, Any]:
    """Inspector keyword arguments (besides model, log_dir, schedule, optimizer) of a config."""
    if config == "wgu":
        return {"families": WGU, "sentinel": False}
    if config == "defaults":
        return {}
    if config == "custom":
        return {"families": families, "sentinel": sentinel}
    raise SystemExit(f"unknown config {config!r} (choose from wgu, defaults, custom)")


def read_events(log_dir: str) -> dict[str, Any]:
    """File bytes, sampled steps written, mean serialized bytes per histogram value, and the
    ``layerwatch/overhead_ms`` scalar per step."""
    files = list(Path(log_dir).glob("events.out.tfevents.*"))
    steps, histo_sizes, overhead = set(), [], {}
    for f in files:
        for event in LegacyEventFileLoader(str(f)).Load():
            for value in event.summary.value:
                if value.HasField("histo"):
                    steps.add(event.step)
                    histo_sizes.append(value.ByteSize())
                elif value.tag == OVERHEAD_TAG:
                    overhead[event.step] = value.simple_value
    return {
        "size": sum(f.stat().st_size for f in files),
        "histogram_steps": len(steps),
        "per_histogram": statistics.mean(histo_sizes) if histo_sizes else 0.0,
        "overhead_ms": overhead,
    }


def import_wandb():
    try:
        import wandb
    except ImportError:
        return None
    except Exception as exc:  # installed but broken (e.g. a protobuf clash): say so, go on without it
        print(f"import wandb failed, no wandb figure: {exc!r}", file=sys.stderr)
        return None
    return wandb


def wandb_times(wandb, model: torch.nn.Module, step, rounds: int, tmp: str, clock: Clock) -> Optional[list[float]]:
    """Rounds of an untimed then a timed step under ``wandb.watch(log="all", log_freq=1)``, offline."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    os.makedirs(tmp, exist_ok=True)
    try:
        run = wandb.init(dir=tmp, mode="offline", project="layerwatch-overhead")
    except Exception as exc:  # a broken install should not cost the inspector's figures
        print(f"wandb.init failed, no wandb figure: {exc!r}", file=sys.stderr)
        return None
    times = []
    try:
        wandb.watch(model, log="all", log_freq=1)
        for _ in range(rounds):
            run.log({"loss": float(step())})  # untimed: commits anything a previous step left
            times.append(clock.time(lambda: run.log({"loss": float(step())})))
    finally:
        unwatch = getattr(run, "unwatch", None) or wandb.unwatch
        unwatch(model)
        run.finish()
    return times


def run(
    name: str, config: str, rounds: int, naive_rounds: int, wandb_rounds: int, families: tuple, sentinel: bool,
    device: str = "cpu", compiled: Optional[str] = None,
) -> dict:
    clock = Clock(device)
    model, opt, step = WORKLOADS[name](device=clock.device)
    if compiled:
        model.compile(backend=compiled)
    params = [p for p in model.parameters()]
    warm_up = lambda: [step() for _ in range(2)]  # noqa: E731
    if not compiled:  # compiled: after the inspector starts, so that the first compiled forward has its hooks
        warm_up()
    times: dict[str, list[float]] = {
        "base": [], "off": [], "off_call": [], "arm_call": [], "sampled": [], "after": [], "read_once": [], "naive": [],
        "wandb": []
    }
    wandb = import_wandb() if wandb_rounds > 0 else None
    hooks = HookSpans(opt, clock)  # the off-step's share of the inspector's optimizer hooks (its sentinel check)
    with tempfile.TemporaryDirectory() as tmp:
        inspector = Inspector(
            model,
            log_dir=f"{tmp}/lw",
            schedule=lambda k: k % 4 == 2,
            optimizer=opt,
            **config_kwargs(config, families, sentinel),
        )
        with inspector:
            hooks.after_inspector()
            if compiled:
                warm_up()
            logged_families = ",".join(sorted(inspector.families, key=FAMILIES.index))
            empty_size = read_events(f"{tmp}/lw")["size"]

            def base() -> None:
                times["base"].append(clock.time(step))

            def inspected() -> None:
                # a pure off-step (neither this step nor the next is sampled: k % 4 == 0, opening 1)
                hooks.take()
                off_step, off_call = clock.times(step, inspector.step)
                times["off"].append(off_step + off_call)
                times["off_call"].append(off_call + hooks.take())
                # its inspector.step() opens (arms) sampled step k % 4 == 2: that call is the sample's
                step()
                arm, sampled, after = clock.times(
                    inspector.step, lambda: (step(), inspector.step()), lambda: (step(), inspector.step())
                )
                times["arm_call"].append(arm)
                times["sampled"].append(arm + sampled)
                times["after"].append(after)

            def read_once() -> None:
                times["read_once"].append(clock.time(lambda: (step(), torch._foreach_norm(params + [p.grad for p in params]))))

            blocks = [base, inspected, read_once]
            for r in range(rounds):
                step()  # untimed: absorbs any after-effect of the previous round
                for block in blocks[r % 3 :] + blocks[: r % 3]:  # rotate: no condition owns a position
                    block()
        hooks.remove()
        events = read_events(f"{tmp}/lw")
        if naive_rounds > 0:
            naive_writer = SummaryWriter(f"{tmp}/naive")
            for r in range(naive_rounds):
                def naive() -> None:
                    step()
                    for pname, p in model.named_parameters():
                        naive_writer.add_histogram(f"weights/{pname}", p, r)
                        naive_writer.add_histogram(f"grads/{pname}", p.grad, r)
                    naive_writer.flush()

                step()
                times["naive"].append(clock.time(naive))
            naive_writer.close()
        if wandb is not None:
            times["wandb"] = wandb_times(wandb, model, step, wandb_rounds, f"{tmp}/wandb", clock) or []
    base = times["base"]
    base_median = statistics.median(base)
    ratio = {k: statistics.median(t / base[i % len(base)] for i, t in enumerate(v)) for k, v in times.items() if v}
    off_direct = 1 + statistics.median(times["off_call"]) / base_median  # base plus the measured call
    overhead = events["overhead_ms"]
    reported = [overhead[s] for s in sorted(overhead)[1:]]  # the first sample also records the layer table
    reported_ms = statistics.median(reported) if reported else None  # a median, as the delta is
    delta_ms = 1e3 * (statistics.median(times["sampled"]) - base_median)
    return {
        "workload": name + (" (compiled)" if compiled else ""),
        "config": config,
        "device": clock.name(),
        "families": logged_families,
        "sentinel": config_kwargs(config, families, sentinel).get("sentinel", True),
        "rounds": rounds,
        "tensors": len(params),
        "params": sum(p.numel() for p in params),
        "base_ms": 1e3 * base_median,
        "sampled_ms": 1e3 * statistics.median(times["sampled"]),
        "sampled": ratio["sampled"],
        "first_sampled": times["sampled"][0] / base_median,
        "off": ratio["off"],
        "off_call_us": 1e6 * statistics.median(times["off_call"]),
        "after": ratio["after"],
        "amortized@50": (ratio["sampled"] + ratio["after"] + 48 * off_direct) / 50,
        "read_once": ratio["read_once"],
        "reported_overhead_ms": reported_ms,
        "sampled_delta_ms": delta_ms,
        "reported_over_delta": reported_ms / delta_ms if reported_ms is not None and delta_ms > 0 else None,
        "wandb": ratio.get("wandb"),
        "naive": ratio.get("naive"),
        "bytes_per_sampled_step": (events["size"] - empty_size) / max(len(overhead), 1),
        "bytes_per_histogram": events["per_histogram"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="gpt,cnn,stack32,tfm,tfm-tiny", help=f"from {','.join(WORKLOADS)}")
    parser.add_argument("--configs", default="wgu,defaults", help="from wgu, defaults, custom")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--naive-rounds", type=int, default=0, help="rounds of the add_histogram baseline (default: none)")
    parser.add_argument("--wandb-rounds", type=int, default=3, help="rounds of wandb.watch when wandb imports (0: skip)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="families of the custom config (default: all)")
    parser.add_argument("--no-sentinel", action="store_true", help="turn the sentinel off in the custom config")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (timed with CUDA events)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="model.compile() each workload first (default backend: inductor)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        clock = Clock(args.device)
    except (RuntimeError, ValueError) as exc:
        parser.error(f"--device {args.device!r}: {exc}")
    if clock.cuda and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: torch sees no CUDA device")
    families = tuple(args.families.split(","))
    configs = args.configs.split(",")
    for config in configs:
        config_kwargs(config, families, not args.no_sentinel)  # fail on a typo before any work
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
    wandb = import_wandb() if args.wandb_rounds > 0 else None
    naive = args.naive_rounds > 0
    if not args.json:
        print_header(args, clock, configs, wandb, naive)
    for name in args.workloads.split(","):  # each row as it is measured: a time limit keeps those done
        for config in configs:
            result = run(name, config, args.rounds, args.naive_rounds, args.wandb_rounds, families, not args.no_sentinel,
                         args.device, args.compile)
            print(json.dumps(result) if args.json else row(result, naive), flush=True)
    if wandb is not None and hasattr(wandb, "teardown"):
        wandb.teardown()


def print_header(args: argparse.Namespace, clock: Clock, configs: list[str], wandb: Any, naive: bool) -> None:
    print(f"torch {torch.__version__}, {clock.name()}, rounds={args.rounds}, "
          f"wandb={'yes' if wandb is not None else 'not importable' if args.wandb_rounds > 0 else 'skipped'}"
          + (f", custom: families={args.families} sentinel={'off' if args.no_sentinel else 'on'}" if "custom" in configs else ""))
    columns = ["workload", "config", "tensors", "base step", "sampled step", "sampled", "first sampled", "off-step", "off-step call",
               "after sample", "amortized@50", "read once", "reported overhead_ms", "sampled delta", "reported/delta",
               "wandb"] + (["naive"] if naive else [])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns), flush=True)


def row(r: dict, naive: bool) -> str:
    """One result as a row of the table."""

    def fmt(value: Optional[float], spec: str, unit: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{unit}"

    cells = [
        r["workload"], r["config"], str(r["tensors"]), f"{r['base_ms']:.1f} ms", f"{r['sampled_ms']:.1f} ms",
        f"{r['sampled']:.3f}x", f"{r['first_sampled']:.2f}x", f"{r['off']:.3f}x", f"{r['off_call_us']:.1f} us",
        f"{r['after']:.3f}x", f"{r['amortized@50']:.4f}x", f"{r['read_once']:.3f}x",
        fmt(r["reported_overhead_ms"], ".2f", " ms"), f"{r['sampled_delta_ms']:.2f} ms",
        fmt(r["reported_over_delta"], ".2f"), fmt(r["wandb"], ".2f", "x"),
    ] + ([fmt(r["naive"], ".2f", "x")] if naive else [])
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
