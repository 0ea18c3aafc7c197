"""The ``layerwatch`` command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Optional, Sequence, Union

from layerwatch import __version__

_FORMATS = ("table", "csv", "json")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _step(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number (an integer >= 0), got {text!r}") from None


def _step_choice(text: str) -> Union[list[int], slice]:
    """``--steps``: ``N,N,...`` (a list) or ``START:STOP[:STEP]`` (a slice; either end may be
    left empty). The values are checked where they are used (``load_histograms``)."""
    try:
        if ":" not in text:
            return [int(n) for n in text.split(",")]
        parts = [int(n) if n.strip() else None for n in text.split(":")]
        if len(parts) <= 3:
            return slice(*parts)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected step numbers (N,N,...) or START:STOP[:STEP], got {text!r}")


def _names(text: str) -> list[str]:
    """``--tensors``: ``GLOB[,GLOB]``."""
    return [name.strip() for name in text.split(",") if name.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="layerwatch", description="Watch the inside of a PyTorch model while it trains.")
    parser.add_argument("--version", action="version", version=f"layerwatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a small built-in model with Lightning and InspectCallback; write TensorBoard logs"
    )
    demo.add_argument("--steps", type=_positive, default=8000, help="optimizer steps (default 8000)")
    demo.add_argument("--logdir", default="runs/layerwatch-demo", help="TensorBoard log directory")
    demo.add_argument("--every", type=_positive, default=50, help="sample every N steps (default 50)")
    demo.add_argument(
        "--inject-nan", type=_step, default=None, metavar="STEP",
        help="make the layer encoder.fault emit a NaN at STEP (0 to --steps - 1); layerwatch replays that step to name it",
    )
    demo.add_argument(
        "--inject-spike", type=_step, default=None, metavar="STEP",
        help="make the layer encoder.fault multiply its output by -1000 at STEP (0 to --steps - 1): a loss spike, "
        "which layerwatch samples and explains",
    )
    summary = commands.add_parser(
        "summary",
        help="print the per-layer table (shapes, parameters, bytes, MACs) of a model built by a factory",
        description="Build a model with FACTORY (package.module:callable, or a module instance), run one forward "
        "on generated inputs under torch.no_grad(), and print one row per module.",
    )
    summary.add_argument("factory", metavar="FACTORY", help="package.module:callable returning an nn.Module")
    summary.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="SHAPE[:DTYPE]",
        help="one positional input, e.g. 32x1x28x28 or 8x128:int64 (repeat for several; floats are random normal, "
        "integers are zeros)",
    )
    summary.add_argument("--dtype", default=None, help="report bytes as if floating tensors were fp32, fp16, bf16 or int8")
    summary.add_argument("--format", choices=_FORMATS, default="table", help="output format (default table)")
    report = commands.add_parser(
        "report",
        help="summarize a TensorBoard log directory: alerts, loss spikes, first NaN/Inf, extreme norms",
        description="Read a finished or running log directory (every run under it) with TensorBoard's "
        "event reader and print the alerts, the loss spikes, the first non-finite step, the largest and fastest-changing norms, "
        "and the slowest and largest layers when they were logged. With --html, write instead one HTML file "
        "that shows the runs as the LAYERWATCH tab does, in any browser, offline (see docs/layer-view.md).",
    )
    report.add_argument("logdir", metavar="LOGDIR", help="a TensorBoard log directory")
    report.add_argument("--json", action="store_true", help="print one JSON object (see docs/alerts.md)")
    report.add_argument(
        "--html", metavar="OUT.html", default=None,
        help="write the runs as one self-contained HTML file to share (a bug report, a pull request, a chat): the "
        "LAYERWATCH tab's heatmaps, events, rankings and layer details, with no server and no file beside it",
    )
    report.add_argument("--runs", metavar="GLOB", default=None, help="with --html: only the runs whose name matches")
    report.add_argument(
        "--stats", type=_names, default=None, metavar="KEY[,KEY]",
        help="with --html: only these statistics (the tab's keys: grads_norm, weights_norm, fwd_ms, ...); "
        "the events and rankings stay whole",
    )
    report.add_argument(
        "--steps", type=_step_choice, default=None, metavar="STEPS",
        help="with --html: only the samples at these steps: N,N,... or START:STOP[:STEP] (as layerwatch export)",
    )
    report.add_argument(
        "--every-nth", type=_positive, default=None, metavar="N",
        help="with --html: every Nth sample (of those --steps keeps), and the samples of the first NaN/Inf and "
        "of the spikes",
    )
    report.add_argument(
        "--fail-on",
        metavar="KIND[,KIND]",
        default=None,
        help="exit with status 1 when alerts of these kinds exist (dead, stuck, exploding, vanishing, nonfinite, spike, any); "
        "with status 2 when LOGDIR holds no layerwatch data to judge",
    )
    export = commands.add_parser(
        "export",
        help="write layerwatch's data in a log directory as three tables: scalars, histograms, alerts",
        description="Read every run under LOGDIR (as layerwatch.load, load_histograms and load_alerts do) and "
        "write scalars, histograms and alerts into OUT as CSV (default) or Parquet files.",
    )
    export.add_argument("logdir", metavar="LOGDIR", help="a TensorBoard log directory")
    export.add_argument("--out", required=True, metavar="DIR", help="directory to write the three tables into")
    export.add_argument("--format", choices=("csv", "parquet"), default="csv", help="file format (default csv)")
    export.add_argument("--runs", default=None, metavar="GLOB", help="only the runs whose name matches (default: all)")
    export.add_argument(
        "--tensors", type=_names, default=None, metavar="GLOB[,GLOB]",
        help="only these histograms: tensor names or globs (h.*.mlp.c_fc.weight: its weights/ and grads/), or whole "
        "tags with a / (grads/h.*); the scalars and alerts are written whole",
    )
    export.add_argument(
        "--steps", type=_step_choice, default=None, metavar="STEPS",
        help="only the histograms of these steps: N,N,... or START:STOP[:STEP] (STOP left out, as in Python; "
        "1000: is step 1000 on); the scalars and alerts are written whole",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        _check_demo(demo, args)
        from layerwatch.demo import run_demo

        run_demo(steps=args.steps, log_dir=args.logdir, every=args.every, inject_nan=args.inject_nan,
                 inject_spike=args.inject_spike)
    elif args.command == "summary":
        return _summary(summary, args)
    elif args.command == "report":
        return _report(report, args)
    elif args.command == "export":
        return _export(export, args)
    return 0


def _check_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check alone, before Lightning is imported; exits 2 naming the bad value."""
    from layerwatch.options import writable_dir

    for flag, step in (("--inject-nan", args.inject_nan), ("--inject-spike", args.inject_spike)):
        if step is not None and not 0 <= step < args.steps:
            parser.error(f"argument {flag}: step {step} is outside the run; choose a step in "
                         f"0..{args.steps - 1} (--steps {args.steps})")
    try:
        writable_dir(args.logdir)
    except ValueError as e:
        cause = e.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else "it does not name a directory"
        parser.error(f"argument --logdir: cannot create or write to {args.logdir!r}: {reason}")


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import json

    if args.html is not None:
        return _share(parser, args)
    for flag, value in (("--runs", args.runs), ("--stats", args.stats), ("--steps", args.steps),
                        ("--every-nth", args.every_nth)):
        if value is not None:
            parser.error(f"argument {flag}: only with --html (it narrows the file written)")
    from layerwatch.health.alert import KINDS
    from layerwatch.reading.report import ReportError, build_report, format_report, has_layerwatch_data

    fail_on: set[str] = set()
    if args.fail_on is not None:
        fail_on = {kind.strip() for kind in args.fail_on.split(",") if kind.strip()}
        unknown = sorted(fail_on - set(KINDS) - {"any"})
        if unknown or not fail_on:
            parser.error(f"--fail-on: unknown kind {', '.join(map(repr, unknown or ['']))}; choose from "
                         f"{', '.join(KINDS)}, any")
    try:
        result = build_report(args.logdir)
    except ReportError as e:
        parser.error(str(e))
    _print(json.dumps(result, indent=2) if args.json else format_report(result))
    if fail_on and not has_layerwatch_data(result):
        print(f"layerwatch report: no layerwatch data in {args.logdir!r} ({len(result['runs'])} run(s) with other "
              f"writers' tags only); cannot judge --fail-on {args.fail_on}", file=sys.stderr)
        return 2
    failing = [a for a in result["alerts"] if a["kind"] in fail_on or "any" in fail_on]
    if failing:
        kinds = ", ".join(sorted({a["kind"] for a in failing}))
        print(f"layerwatch report: {len(failing)} alert(s) of kind {kinds} (--fail-on {args.fail_on})", file=sys.stderr)
        return 1
    return 0


def _share(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``report --html``: the runs as one HTML file; exits 2 naming what is wrong, with no file written."""
    from layerwatch.reading.notebook import chosen_steps
    from layerwatch.tensorboard_plugin.share import Narrowing, ShareError, write_html

    for flag, value in (("--json", args.json), ("--fail-on", args.fail_on)):
        if value:
            parser.error(f"argument {flag}: not with --html (it writes the file only)")
    if args.stats == []:
        parser.error("argument --stats: expected statistic keys, e.g. grads_norm,fwd_ms")
    try:
        steps = chosen_steps(args.steps)
    except (TypeError, ValueError) as e:
        parser.error(f"argument --steps: {e}")
    try:
        shared = write_html(args.logdir, args.html, runs=args.runs,
                            narrowing=Narrowing(stats=args.stats, steps=steps, every_nth=args.every_nth))
    except ShareError as e:
        parser.error(str(e))
    print(f"{shared.path}: {shared.size / 2**20:.1f} MiB, {len(shared.runs)} run(s) ({', '.join(shared.runs)}), "
          f"{shared.stats} statistics, {shared.layers:,} layer details; open it in any browser, no server needed")
    return 0


def _export(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The three tables of ``layerwatch.load`` into ``--out``; exits 2 when pandas (or, for
    Parquet, pyarrow) is missing, naming what to install."""
    import importlib.util

    from layerwatch.options import writable_dir

    needed = ["pandas"] + (["pyarrow"] if args.format == "parquet" else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        extra = 'pip install "layerwatch[pandas]"' + (" pyarrow" if "pyarrow" in missing else "")
        print(f"layerwatch export: --format {args.format} needs {' and '.join(missing)}: {extra}", file=sys.stderr)
        return 2
    try:
        out = writable_dir(args.out)
    except ValueError:
        parser.error(f"argument --out: cannot create or write to {args.out!r}")
    from layerwatch.reading.notebook import load, load_alerts, load_histograms

    try:
        # First: it checks --tensors and --steps before anything is read.
        histograms = load_histograms(args.logdir, args.runs, tensors=args.tensors, steps=args.steps)
        tables = {"scalars": load(args.logdir, args.runs), "histograms": histograms,
                  "alerts": load_alerts(args.logdir, args.runs)}
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    for name, frame in tables.items():
        path = out / f"{name}.{args.format}"
        if args.format == "csv":
            frame.to_csv(path, index=False)
        else:
            frame.to_parquet(path, index=False)
        print(f"{path}: {len(frame):,} rows")
    return 0


def _print(text: str) -> None:
    try:
        print(text.rstrip("\n"), flush=True)
    except BrokenPipeError:  # `layerwatch ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _summary(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from layerwatch.table.summarize import summarize
    from layerwatch.table.summary import as_dtype

    try:
        inputs = [_make_input(spec) for spec in args.input]
        dtype = None if args.dtype is None else as_dtype(args.dtype)
        model = _build(args.factory)
    except ValueError as e:
        parser.error(str(e))
    try:
        table = summarize(model, *inputs)
    except RuntimeError as e:
        print(f"layerwatch summary: {e}", file=sys.stderr)
        return 1
    if dtype is not None:
        table = table.at(dtype=dtype)
    _print({"table": table.to_text, "csv": table.to_csv, "json": table.to_json}[args.format]())
    return 0


def _make_input(spec: str) -> Any:
    import torch

    shape_text, _, dtype_text = spec.partition(":")
    try:
        shape = [int(n) for n in shape_text.lower().split("x")]
    except ValueError:
        shape = []
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"--input {spec!r}: expected a shape like 32x1x28x28 (positive sizes joined by 'x')")
    dtype = getattr(torch, dtype_text or "float32", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--input {spec!r}: unknown dtype {dtype_text!r} (e.g. float32, float16, int64)")
    try:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        return torch.zeros(shape, dtype=dtype)
    except RuntimeError as e:  # too large to allocate, or a dtype that cannot be made this way
        reason = str(e).splitlines()[0]
        reason = reason.split(". ")[0] if len(reason) > 300 else reason
        raise ValueError(f"--input {spec!r}: cannot make this tensor: {reason}") from e


def _build(factory: str) -> Any:
    """The model that ``package.module:callable`` names (called with no arguments), or names directly.

    Raises:
        ValueError: anything wrong with ``factory``, naming it.
    """
    from torch import nn

    module_name, colon, attribute = factory.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"FACTORY must look like package.module:callable, got {factory!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: a factory in the current directory
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} (from {factory!r}): {e}") from e
    except Exception as e:  # the module itself failed while being imported
        raise ValueError(f"importing {module_name!r} (from {factory!r}) raised {type(e).__name__}: {e}") from e
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{factory!r}: {getattr(target, '__name__', target)!r} has no attribute {part!r}")
        target = getattr(target, part)
    model = target
    if callable(target) and not isinstance(target, nn.Module):
        try:
            model = target()
        except Exception as e:
            raise ValueError(f"{factory!r} failed when called with no arguments: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"{factory!r} gave a {type(model).__name__}, not a torch.nn.Module")
    return model


if __name__ == "__main__":
    raise SystemExit(main())
