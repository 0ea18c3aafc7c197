"""``layerwatch report LOGDIR``: what a person wants first from a log directory, without a server.

Summarizes each run: the alerts, the first non-finite step, the largest and
fastest-changing weight and gradient norms, (when the runtime probes wrote them) the
slowest layers and the largest memory, and (for a run with Mixture-of-Experts routers) the most
imbalanced routers and the dead experts. A run without any of layerwatch's tags says so. The
text form and the JSON form are documented in ``docs/alerts.md``.

The event files are read by :mod:`layerwatch.reading.events`: each record parsed whole, with
TensorBoard's own proto.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from layerwatch.reading import events as E
from layerwatch.reading import rankings
from layerwatch.reading.events import Reader, ReportError, find_runs
from layerwatch.reading.experts import dead_now, experts_of, most_imbalanced
from layerwatch import vocabulary as V

_NORMS = {family: V.series_key(family, "norm") for family in V.TENSOR_FAMILIES}  # series keys
_NONFINITE = tuple(V.series_key(family, "nonfinite") for family in V.TENSOR_FAMILIES)
_TIMES = V.TIME_SERIES
_BYTES = V.MEMORY_SERIES
_SERIES = (*_NORMS.values(), *_NONFINITE, *_TIMES, *_BYTES)
CARD_PREFIXES = (*(key + "/" for key in _SERIES), V.RUN_WIDE)  # a log written before the tab existed has these
# A run holds layerwatch data when any tag has one of these prefixes ("layerwatch/": the run-wide
# scalars and texts, and the tensors of the TensorBoard plugin named "layerwatch").
_LAYERWATCH_PREFIXES = (
    V.RUN_WIDE,
    *(V.stat_prefix(family, stat) for family in (*V.TENSOR_FAMILIES, "activations") for stat in V.STATS),
    *(V.module_prefix(name) for name in V.MODULE_SCALARS),
    V.update_ratio_tag(""),
)
SPIKES = V.EVENTS + "spikes"
RERUN = V.EVENTS + "rerun"  # a compiled model's per-module values: of its eager re-run
OTHER_TAGS_SHOWN = 5
DEAD_SHOWN = 10  # dead experts listed in the text (the JSON has them all)
NAME_WIDTH = 60  # longer layer names lose their middle


@dataclass
class _Run:
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # the cards read
    tab: Reader = field(default_factory=Reader)  # the LAYERWATCH tab's data: every per-layer value
    alerts_text: Optional[tuple[int, str]] = None  # (step, table) of the latest alerts table
    layerwatch: bool = False  # some tag is one of layerwatch's
    other_tags: set[str] = field(default_factory=set)  # the tags seen before the first of layerwatch's


def has_layerwatch_data(report: dict[str, Any]) -> bool:
    """Whether any run of ``report`` holds a tag that layerwatch writes."""
    return any(run["layerwatch_data"] for run in report["runs"])


def build_report(logdir: str | os.PathLike) -> dict[str, Any]:
    """The report as plain data: ``{"logdir", "alerts": [...], "runs": [...]}``.

    Raises:
        ReportError: ``logdir`` is missing, not a directory, holds no event files, or one
            cannot be read.
    """
    try:
        runs = [_summarize(name, _read(files)) for name, files in find_runs(logdir).items()]
    except OSError as e:  # unreadable, or removed since it was listed
        raise ReportError(f"cannot read {e.filename or logdir!r}: {e.strerror or e}") from e
    alerts = [dict(alert, run=run["run"]) for run in runs for alert in run["alerts"]]
    return {"logdir": str(logdir), "alerts": alerts, "runs": runs}


def _read(files: list[Path]) -> _Run:
    run = _Run()
    for path in files:
        for event in E.events(path):
            if not event.HasField("summary"):
                continue
            step = event.step
            for value in event.summary.value:
                if not run.layerwatch:
                    if value.tag.startswith(_LAYERWATCH_PREFIXES):
                        run.layerwatch = True
                    else:
                        run.other_tags.add(value.tag)
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    if value.tag.startswith(CARD_PREFIXES):
                        run.scalars.setdefault(value.tag, []).append((step, value.simple_value))
                elif kind == "tensor" and value.tag.startswith((V.SERIES, V.LAYOUT, SPIKES, RERUN)):
                    run.tab.add_tensor(step, event.wall_time, value.tag, value.tensor)
                elif kind == "tensor" and value.tag == V.ALERTS_TEXT and value.tensor.string_val:
                    if run.alerts_text is None or step >= run.alerts_text[0]:
                        run.alerts_text = (step, value.tensor.string_val[0].decode("utf-8", "replace"))
    return run


def _summarize(name: str, run: _Run) -> dict[str, Any]:
    from layerwatch.health.alert import parse_alerts_markdown  # here: the rest of the report needs no torch

    alerts = [] if run.alerts_text is None else [a.as_dict() for a in parse_alerts_markdown(run.alerts_text[1])]
    spikes = sorted((spike for _, events in run.tab.events for spike in events.get("spikes", [])), key=lambda s: s["step"])
    tabled = {(a["kind"], a["step"]) for a in alerts}  # a run without the health rules has no table: its spikes are alerts still
    for s in spikes:  # a step's spikes (the loss's, the gradient norm's): one alert, as the health rules raise it
        if ("spike", s["step"]) not in tabled:
            tabled.add(("spike", s["step"]))
            alerts.append({"kind": "spike", "name": s["layer"], "step": s["step"], "message": s["message"]})
    tables = {key: _series_table(run, key) for key in _SERIES}
    steps = sorted({step for tag, series in run.scalars.items() if tag not in V.LEAD_UPS for step, _ in series}  # a lead-up: not samples
                   | set(run.tab.steps()))
    nonfinite = _first_nonfinite([tables[key] for key in _NONFINITE])
    until = None if nonfinite is None else nonfinite["step"]  # norms of finite values mean little after it
    return {
        "run": name,
        "layerwatch_data": run.layerwatch,
        "other_tags": [] if run.layerwatch else sorted(run.other_tags)[:OTHER_TAGS_SHOWN],
        "steps": {"first": steps[0], "last": steps[-1], "samples": len(steps)} if steps else None,
        "alerts": alerts,
        "first_nonfinite": nonfinite,
        "spikes": spikes,
        "norms_until_step": until,
        "weights": rankings.norms(tables[_NORMS["weights"]], until),
        "grads": rankings.norms(tables[_NORMS["grads"]], until),
        "slowest": rankings.top_by_median([tables[key] for key in _TIMES], unit="ms"),
        "largest_memory": rankings.top_by_median([tables[key] for key in _BYTES], unit="bytes"),
        "rerun": any(events.get("rerun") for _, events in run.tab.events),  # a compiled model's: forward only, eager
        "experts": _experts(run.tab),
    }


def _experts(tab: Reader) -> Optional[dict[str, Any]]:
    """A run's Mixture-of-Experts routers: how many, the most imbalanced and the dead experts;
    None without routers."""
    experts = experts_of(tab)
    if experts is None:
        return None
    return {"routers": len(experts.routers), "experts": int(experts.tokens.shape[0]),
            "most_imbalanced": most_imbalanced(experts), "dead": dead_now(experts)}


def _series_table(run: _Run, key: str) -> rankings.Table:
    """A series from the tab's data, or (a log written before it) from the cards."""
    if key in run.tab.keys():
        return run.tab.table(key)
    prefix = key + "/"
    return rankings.Table.from_points({tag[len(prefix) :]: points for tag, points in run.scalars.items()
                                       if tag.startswith(prefix)})


def _first_nonfinite(tables: list[rankings.Table]) -> Optional[dict[str, Any]]:
    """The earliest step with a positive NaN/Inf count, and every tensor counted at it."""
    hits: dict[int, list[str]] = {}
    for key, table in zip(_NONFINITE, tables):
        if table.values.size == 0:
            continue
        positive = table.values > 0
        first = positive.argmax(axis=1)
        for i in np.flatnonzero(positive.any(axis=1)).tolist():
            hits.setdefault(int(table.steps[first[i]]), []).append(f"{key}/{table.names[i]}")
    if not hits:
        return None
    step = min(hits)
    return {"step": step, "tensors": sorted(hits[step])}


# ---------------------------------------------------------------------- text


def format_report(report: dict[str, Any]) -> str:
    """The report as text. Bytes are in binary units (``1.5 MiB``); a change of a norm reads
    ``×2.5`` (grew 2.5 times) or ``÷40`` (shrank 40 times); a layer name longer than
    ``NAME_WIDTH`` keeps its start and end around ``…``."""
    runs = report["runs"]
    lines = [f"layerwatch report: {report['logdir']} ({len(runs)} run{'s' if len(runs) != 1 else ''})"]
    if not has_layerwatch_data(report):
        lines.append(f"No layerwatch data in {report['logdir']}: its event files hold none of layerwatch's tags "
                     "(was it written by Inspector or InspectCallback?)")
    for run in runs:
        if not run["layerwatch_data"]:
            shown = ", ".join(run["other_tags"]) if run["other_tags"] else "no tags"
            lines += ["", f"== {run['run']}: no layerwatch data (other writers' tags only: {shown})"]
            continue
        steps = run["steps"]
        covered = f"steps {steps['first']}..{steps['last']}, {steps['samples']} sampled" if steps else "no samples"
        lines += ["", f"== {run['run']}: {covered}"]
        lines += _alert_lines(run) + _spike_lines(run) + [_nonfinite_line(run)] + _norm_lines(run) + _cost_lines(run)
        lines += _expert_lines(run.get("experts"))
    return "\n".join(lines)


def _alert_lines(run: dict[str, Any]) -> list[str]:
    lines = [f"Alerts ({len(run['alerts'])}):" if run["alerts"] else "Alerts: none"]
    return lines + [f"  step {a['step']:<8} {a['kind']:<10} {a['name']}: {a['message']}" for a in run["alerts"]]


def _spike_lines(run: dict[str, Any]) -> list[str]:
    lines = [f"Loss spikes ({len(run['spikes'])}):" if run["spikes"] else "Loss spikes: none"]
    for spike in run["spikes"]:
        grew = ", ".join(f"{g['layer']} ({g['what']} {_factor(g['factor'])})" for g in spike["layers"][:3])
        began = spike["origin"][0] if spike["origin"] else None
        how = "replayed" if spike["replayed"] else f"measured at step {spike['sampled_at']}"
        against = (f"{_factor(spike['value'] / spike['mean'])} the geometric mean {_number(spike['mean'])} of "
                   f"{spike['over']} steps, z = {_number(spike['z'])} on its logarithm" if spike.get("scale") == "log"
                   else f"z = {_number(spike['z'])} over the mean {_number(spike['mean'])} of {spike['over']} steps")
        lines.append(f"  step {spike['step']:<8} {spike['what']} {_number(spike['value'])}, {against}; {how}"
                     + (f"; began at {began['layer']} (output {_factor(began['factor'])} its input's)" if began else "")
                     + (f"; grew most: {grew}" if grew else ""))
    return lines


def _nonfinite_line(run: dict[str, Any]) -> str:
    nonfinite = run["first_nonfinite"]
    if not nonfinite:
        return "First non-finite: none"
    return (f"First non-finite: step {nonfinite['step']} in {', '.join(nonfinite['tensors'][:6])}"
            + (f" and {len(nonfinite['tensors']) - 6} more" if len(nonfinite["tensors"]) > 6 else ""))


def _norm_lines(run: dict[str, Any]) -> list[str]:
    """The largest and the fastest-changing weight and gradient norms."""
    lines = []
    before = f", before step {run['norms_until_step']}" if run["norms_until_step"] is not None else ""
    for family, label in (("weights", "weight"), ("grads", "gradient")):
        norms = run[family]
        if norms["largest"]:
            lines.append(f"Largest {label} norms (last sample{before}):")
            lines += _table([[row["name"], _number(row["value"]), f"(step {row['step']})"]
                             for row in norms["largest"]])
        if norms["fastest_changing"]:
            lines.append(f"Fastest-changing {label} norms (first to last sample{before}):")
            lines += _table([[row["name"], _number(row["first"]), "->", _number(row["last"]),
                              _factor(row["factor"]), f"(steps {row['from_step']}..{row['to_step']})"]
                             for row in norms["fastest_changing"]])
    return lines


def _cost_lines(run: dict[str, Any]) -> list[str]:
    """The slowest layers and the largest memory, or what the log lacks for them."""
    lines = []
    slowest = ("Slowest leaf layers (median fwd of the eager re-run: the model is compiled)" if run.get("rerun")
               else "Slowest leaf layers (median fwd + bwd)")
    for key, label, unit, tags in (
        ("slowest", slowest, "ms", "fwd_ms/, bwd_ms/"),
        ("largest_memory", "Largest memory, leaf layers (median bytes)", "bytes", "activation_bytes/, saved_bytes/"),
    ):
        rows = run[key]
        if rows:
            lines.append(f"{label}:")
            show = _ms if unit == "ms" else _bytes
            lines += _table([[row["name"], show(row[unit]), ""] for row in rows])
        else:
            lines.append(f"{label}: not in this log (no {tags} tags)")
    return lines


def _expert_lines(experts: Optional[dict[str, Any]]) -> list[str]:
    """The most imbalanced routers and the dead experts; nothing for a run without routers."""
    if experts is None:
        return []
    lines = [f"Mixture-of-Experts routers ({experts['routers']} routers, {experts['experts']} experts):"]
    if experts["most_imbalanced"]:
        lines.append("  Most imbalanced (max / mean tokens per expert, 1 = balanced; latest sample, the run's largest):")
        lines += ["  " + line for line in _table([[row["router"], _number(row["imbalance"]), f"(step {row['step']})",
                                                   "largest", _number(row["max"]), f"(step {row['max_step']})"]
                                                  for row in experts["most_imbalanced"]])]
    dead = experts["dead"]
    if not dead:
        lines.append("  Dead experts (no token at the latest sample): none")
        return lines
    lines.append(f"  Dead experts (no token at the latest sample) ({len(dead)}):")
    lines += ["  " + line for line in _table([[V.expert_name(row["router"], row["expert"]), f"since step {row['since']}",
                                               f"({row['samples']} sample{'s' if row['samples'] != 1 else ''})"]
                                              for row in dead[:DEAD_SHOWN]])]
    if len(dead) > DEAD_SHOWN:
        lines.append(f"    … and {len(dead) - DEAD_SHOWN} more")
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as aligned lines: the first cell (a layer name, shortened to ``NAME_WIDTH``)
    left-aligned, numbers right-aligned, the last cell as it is."""
    rows = [[_fit(row[0]), *row[1:]] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(
        cell.ljust(width) if i == 0 else cell if i == len(row) - 1 else cell.rjust(width)
        for i, (cell, width) in enumerate(zip(row, widths))
    ).rstrip() for row in rows]


def _fit(name: str, width: int = NAME_WIDTH) -> str:
    """``name``, or its start and its end (the most telling part) around ``…`` in ``width`` characters."""
    if len(name) <= width:
        return name
    tail = (width - 1) * 2 // 3
    return name[: width - 1 - tail] + "…" + name[-tail:]


def _factor(factor: float) -> str:
    """A ratio of two positive norms: ``×2.5`` grew 2.5 times, ``÷40`` shrank 40 times;
    ``×312,000`` past 100; ``×1.2e7`` past a million."""
    sign, size = ("×", factor) if factor >= 1 else ("÷", 1 / factor)
    if size < 100:
        text = f"{size:.3g}"
    elif size < 1e6:
        text = f"{size:,.0f}"
    else:
        text = _short_exponent(f"{size:.1e}")
    return sign + text


def _number(value: float) -> str:
    """4 significant digits; a power of ten as ``1.9e5`` or ``3.2e-6``."""
    return _short_exponent(f"{value:.4g}")


def _short_exponent(text: str) -> str:
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


def _bytes(value: float) -> str:
    """Binary units: ``512 B``, ``1.5 KiB``, ``12.0 MiB``, ``3.2 GiB``."""
    if abs(round(value)) < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(round(value, 1)) < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _ms(value: float) -> str:
    return f"{value:,.3f} ms" if value < 10 else f"{value:,.1f} ms"
