"""``layerwatch report LOGDIR``: what a person wants first from a log directory, without a server.

Summarizes each run: the alerts, the first non-finite step, the largest and
fastest-changing weight and gradient norms, and (when the runtime probes wrote them) the
slowest layers and the largest memory. The JSON form is documented in ``docs/alerts.md``.

Event files are TFRecord files of TensorBoard ``Event`` protos. Each record is parsed with
TensorBoard's own proto and its length checksum is verified with TensorBoard's own CRC.
The checksum of each record's data is not verified: TensorBoard's reader does that in pure
Python at about 8 s per 100 MB (the histograms are most of the bytes), and a damaged record
fails to parse anyway. A record cut short (a run still writing) ends the file.
"""

from __future__ import annotations

import math
import os
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from layerwatch import record as R
from layerwatch.alerts import parse_alerts_markdown
from layerwatch.probes import ROOT

TOP = 5
_NORMS = {family: R.stat_prefix(family, "norm") for family in R.TENSOR_FAMILIES}
_NONFINITE = tuple(R.stat_prefix(family, "nonfinite") for family in R.TENSOR_FAMILIES)
_TIMES = (R.module_prefix("fwd_ms"), R.module_prefix("bwd_ms"))
_BYTES = (R.module_prefix("activation_bytes"), R.module_prefix("saved_bytes"), R.module_prefix("cuda_alloc_bytes"))
_SCALAR_PREFIXES = (*_NORMS.values(), *_NONFINITE, *_TIMES, *_BYTES, R.RUN_WIDE)
_ALERTS_TEXT = R.ALERTS + "/text_summary"  # the tag torch's text builder gives layerwatch/alerts


class ReportError(Exception):
    """The log directory cannot be reported on (missing, empty, unreadable)."""


@dataclass
class _Run:
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    alerts_text: Optional[tuple[int, str]] = None  # (step, table) of the latest alerts table


def find_runs(logdir: str | os.PathLike) -> dict[str, list[Path]]:
    """Run name (directory relative to ``logdir``, ``"."`` for itself) -> its event files."""
    root = Path(logdir)
    if not root.exists():
        raise ReportError(f"log directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise ReportError(f"{str(root)!r} is not a directory")
    runs: dict[str, list[Path]] = {}
    for directory, _, files in sorted(os.walk(root)):
        events = sorted(Path(directory, f) for f in files if "tfevents" in f)
        if events:
            runs[Path(directory).relative_to(root).as_posix()] = events
    if not runs:
        raise ReportError(f"no TensorBoard event files under {str(root)!r}")
    return runs


def build_report(logdir: str | os.PathLike) -> dict[str, Any]:
    """The report as plain data: ``{"logdir", "alerts": [...], "runs": [...]}``."""
    runs = [_summarize(name, _read(files)) for name, files in find_runs(logdir).items()]
    alerts = [dict(alert, run=run["run"]) for run in runs for alert in run["alerts"]]
    return {"logdir": str(logdir), "alerts": alerts, "runs": runs}


def _events(path: Path) -> Iterator[Any]:
    """The ``Event`` protos of one event file, in order."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    with open(path, "rb") as f:
        while True:
            header = f.read(12)  # uint64 length, uint32 masked CRC of the length
            if len(header) < 12:
                return
            length, length_crc = struct.unpack("<QI", header)
            if masked_crc32c(header[:8]) != length_crc:
                warnings.warn(f"layerwatch report: {path} is damaged after {f.tell() - 12} bytes; read up to there")
                return
            data = f.read(length)
            if len(f.read(4)) < 4 or len(data) < length:
                return  # cut short: still being written
            try:
                yield Event.FromString(data)
            except DecodeError:
                warnings.warn(f"layerwatch report: {path} has a damaged record at byte {f.tell() - length - 16}; skipped")


def _read(files: list[Path]) -> _Run:
    run = _Run()
    for path in files:
        for event in _events(path):
            if not event.HasField("summary"):
                continue
            step = event.step
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    if value.tag.startswith(_SCALAR_PREFIXES):
                        run.scalars.setdefault(value.tag, []).append((step, value.simple_value))
                elif kind == "tensor" and value.tag == _ALERTS_TEXT and value.tensor.string_val:
                    if run.alerts_text is None or step >= run.alerts_text[0]:
                        run.alerts_text = (step, value.tensor.string_val[0].decode("utf-8", "replace"))
    return run


def _summarize(name: str, run: _Run) -> dict[str, Any]:
    alerts = [] if run.alerts_text is None else [a.as_dict() for a in parse_alerts_markdown(run.alerts_text[1])]
    steps = sorted({step for series in run.scalars.values() for step, _ in series})
    nonfinite = _first_nonfinite(run.scalars)
    until = None if nonfinite is None else nonfinite["step"]  # norms of finite values mean little after it
    return {
        "run": name,
        "steps": {"first": steps[0], "last": steps[-1], "samples": len(steps)} if steps else None,
        "alerts": alerts,
        "first_nonfinite": nonfinite,
        "norms_until_step": until,
        "weights": _norms(run.scalars, _NORMS["weights"], until),
        "grads": _norms(run.scalars, _NORMS["grads"], until),
        "slowest": _top_by_median(run.scalars, _TIMES, unit="ms"),
        "largest_memory": _top_by_median(run.scalars, _BYTES, unit="bytes"),
    }


def _first_nonfinite(scalars: dict[str, list[tuple[int, float]]]) -> Optional[dict[str, Any]]:
    """The earliest step with a positive NaN/Inf count, and every tensor counted at it."""
    hits: dict[int, list[str]] = {}
    for tag, series in scalars.items():
        if tag.startswith(_NONFINITE):
            first = next((step for step, value in sorted(series) if value > 0), None)
            if first is not None:
                hits.setdefault(first, []).append(tag)
    if not hits:
        return None
    step = min(hits)
    return {"step": step, "tensors": sorted(hits[step])}


def _norms(
    scalars: dict[str, list[tuple[int, float]]], prefix: str, until: Optional[int]
) -> dict[str, list[dict[str, Any]]]:
    """The largest norms at the last sample (before step ``until``, when given), and those
    that changed most from the first sample to that one."""
    finals, changes = [], []
    for tag, series in scalars.items():
        if not tag.startswith(prefix):
            continue
        finite = [(step, v) for step, v in sorted(series) if math.isfinite(v) and (until is None or step < until)]
        if not finite:
            continue
        name = tag[len(prefix) :]
        (first_step, first), (last_step, last) = finite[0], finite[-1]
        finals.append({"name": name, "step": last_step, "value": last})
        if first > 0 and last > 0 and last_step > first_step:
            changes.append({"name": name, "from_step": first_step, "to_step": last_step, "first": first,
                            "last": last, "factor": last / first})
    finals.sort(key=lambda row: -row["value"])
    changes.sort(key=lambda row: -abs(math.log(row["factor"])))
    return {"largest": finals[:TOP], "fastest_changing": changes[:TOP]}


def _top_by_median(scalars: dict[str, list[tuple[int, float]]], prefixes: tuple[str, ...], unit: str) -> list[dict]:
    """Per module, the sum over ``prefixes`` of each tag's median; the largest first."""
    totals: dict[str, float] = {}
    for tag, series in scalars.items():
        if tag.startswith(prefixes):
            values = sorted(v for _, v in series if math.isfinite(v))
            if values:
                module = tag.split("/", 1)[1]
                totals[module] = totals.get(module, 0.0) + values[len(values) // 2]
    # A parent's time and memory include its children's: rank the leaves, the layers that do the work.
    leaves = {name: value for name, value in totals.items() if not _has_children(name, totals)}
    ranked = sorted(leaves.items(), key=lambda item: -item[1])[:TOP]
    return [{"name": name, unit: value} for name, value in ranked]


def _has_children(name: str, names: dict[str, float]) -> bool:
    if name == ROOT:
        return len(names) > 1
    return any(other.startswith(name + ".") for other in names)


# ---------------------------------------------------------------------- text


def format_report(report: dict[str, Any]) -> str:
    runs = report["runs"]
    lines = [f"layerwatch report: {report['logdir']} ({len(runs)} run{'s' if len(runs) != 1 else ''})"]
    for run in runs:
        steps = run["steps"]
        covered = f"steps {steps['first']}..{steps['last']}, {steps['samples']} sampled" if steps else "no samples"
        lines += ["", f"== {run['run']}: {covered}"]
        lines.append(f"Alerts ({len(run['alerts'])}):" if run["alerts"] else "Alerts: none")
        lines += [f"  step {a['step']:<8} {a['kind']:<10} {a['name']}: {a['message']}" for a in run["alerts"]]
        nonfinite = run["first_nonfinite"]
        lines.append(
            f"First non-finite: step {nonfinite['step']} in {', '.join(nonfinite['tensors'][:6])}"
            + (f" and {len(nonfinite['tensors']) - 6} more" if len(nonfinite["tensors"]) > 6 else "")
            if nonfinite
            else "First non-finite: none"
        )
        before = f", before step {run['norms_until_step']}" if run["norms_until_step"] is not None else ""
        for family, label in (("weights", "weight"), ("grads", "gradient")):
            norms = run[family]
            if norms["largest"]:
                lines.append(f"Largest {label} norms (last sample{before}):")
                lines += [f"  {row['name']:<40} {row['value']:.4g}  (step {row['step']})" for row in norms["largest"]]
            if norms["fastest_changing"]:
                lines.append(f"Fastest-changing {label} norms (first to last sample{before}):")
                lines += [
                    f"  {row['name']:<40} {row['first']:.4g} -> {row['last']:.4g}  ({row['factor']:.3g}x,"
                    f" steps {row['from_step']}..{row['to_step']})"
                    for row in norms["fastest_changing"]
                ]
        for key, label, unit, tags in (
            ("slowest", "Slowest leaf layers (median fwd + bwd)", "ms", "fwd_ms/, bwd_ms/"),
            ("largest_memory", "Largest memory, leaf layers (median bytes)", "bytes", "activation_bytes/, saved_bytes/"),
        ):
            rows = run[key]
            if rows:
                lines.append(f"{label}:")
                lines += [f"  {row['name']:<40} {row[unit]:,.4g} {unit}" for row in rows]
            else:
                lines.append(f"{label}: not in this log (no {tags} tags)")
    return "\n".join(lines)
