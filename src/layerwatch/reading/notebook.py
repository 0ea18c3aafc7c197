"""Your run in a notebook: what layerwatch wrote, as tidy pandas DataFrames.

    >>> import layerwatch
    >>> df = layerwatch.load("runs")                       # doctest: +SKIP
    >>> df[df.series == "grads_norm"].pivot_table("value", "layer", "step")   # doctest: +SKIP

Three tables, one row per value:

- :func:`load`: ``run, step, series, layer, value``. ``series`` is the per-layer series key
  (``grads_norm``, ``update_ratio``, ``fwd_ms``, ``activation_bytes``, ...), read from the
  LAYERWATCH tab's data, which holds every per-layer value (the cards are copies of some of
  them); a run-wide scalar (``layerwatch/grad_norm``) has the tag less ``layerwatch/`` as its
  series (``grad_norm``) and an empty ``layer``. A layer not measured at a step has no row;
  NaN stays NaN. A log written before the tab existed is read from its cards.
- :func:`load_histograms`: ``run, step, tensor, bucket, left, right, count, min, max, num``.
- :func:`load_alerts`: ``run, step, kind, layer, message``; the first offender and the first
  non-finite step have kinds of their own (``first_offender``, ``first_nonfinite_step``).
- :func:`load_experts`: ``run, step, layer, expert, tokens, share, bias``: a Mixture-of-Experts
  router's load, one row per expert.

A run is a directory holding event files, named by its path relative to ``logdir`` (``"."``
for ``logdir`` itself), as TensorBoard names it. Several event files in one directory (a
resumed run) read as one run: a step written twice keeps its later values.

The files are read with the project's own record reader (:mod:`layerwatch.reading.events`), and
for :func:`load`, :func:`load_alerts` and :func:`load_experts` only the values whose tag starts with
``layerwatch/`` are decoded: they are found in each record's bytes, so the cards and
histograms around them cost a byte scan, not a parse. :func:`load_histograms` with
``tensors=`` finds its histograms the same way, and with ``steps=`` skips a record of another
step by its head.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any, Container, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from layerwatch import vocabulary as V
from layerwatch.reading import events as E
from layerwatch.reading.events import Reader, ReportError, find_runs
from layerwatch.reading.experts import experts_of
from layerwatch.reading.report import CARD_PREFIXES

if TYPE_CHECKING:
    import pandas as pd

SCALAR_COLUMNS = ["run", "step", "series", "layer", "value"]
HISTOGRAM_COLUMNS = ["run", "step", "tensor", "bucket", "left", "right", "count", "min", "max", "num"]
ALERT_COLUMNS = ["run", "step", "kind", "layer", "message"]
EXPERT_COLUMNS = ["run", "step", "layer", "expert", "tokens", "share", "bias"]
Runs = Union[str, Sequence[str], None]
Tensors = Union[str, Iterable[str], None]
Steps = Union[Iterable[int], range, slice, None]

_MARK = V.RUN_WIDE.encode()
# The tag prefixes of layerwatch's histograms: weights/, grads/, activations/.
_HISTOGRAM_MARKS = tuple(V.histogram_tag(family, "").encode() for family in (*V.TENSOR_FAMILIES, "activations"))


def load(logdir: str | os.PathLike, runs: Runs = None) -> "pd.DataFrame":
    """Every value layerwatch wrote under ``logdir``, one row per (run, step, series, layer).

    Args:
        logdir: A run's directory, or a directory of runs.
        runs: A run's name, a list of names, or a glob (``"lr-*"``); every run by default.

    Raises:
        ImportError: pandas is not installed (``pip install "layerwatch[pandas]"``).
        FileNotFoundError: ``logdir`` does not exist.
        ValueError: ``logdir`` holds no event files, no run matches ``runs``, or no chosen run
            holds layerwatch's data (the message lists the runs found).
    """
    pd = _pandas()
    frames = []
    for name, scan in _scan_runs(logdir, runs).items():
        frames += [_series_frame(pd, name, key, *scan.tab.matrix(key)) for key in scan.tab.keys()]
        frames += [_series_frame(pd, name, *_card_matrix(key, points)) for key, points in scan.cards().items()]
        for tag, by_step in scan.run_wide.items():
            steps = sorted(by_step)
            frames.append(pd.DataFrame({
                "run": name, "step": np.asarray(steps, dtype=np.int64), "series": tag[len(V.RUN_WIDE):], "layer": "",
                "value": np.asarray([by_step[s][1] for s in steps], dtype=np.float64),
            }))
    return _concat(pd, frames, SCALAR_COLUMNS, {"step": np.int64, "value": np.float64})


def load_histograms(logdir: str | os.PathLike, runs: Runs = None, *, tensors: Tensors = None,
                    steps: Steps = None) -> "pd.DataFrame":
    """The histograms under ``logdir``, one row per (run, step, tensor, bucket): the bucket's
    ``left`` and ``right`` edges and ``count``, and the histogram's exact ``min``, ``max`` and
    ``num`` (its number of values), as TensorBoard's record holds them. The first bucket's left
    edge is the histogram's ``min``; the counts of a histogram sum to its ``num``.

    Only what is asked for is read: a record of a step not in ``steps`` is skipped by its head,
    and with ``tensors`` only the chosen histograms of a record are parsed (found by a byte
    scan of their tags, as :func:`load` finds its values).

        >>> layerwatch.load_histograms("runs", tensors="transformer.h.*.mlp.c_fc.weight",
        ...                            steps=slice(1000, None))   # doctest: +SKIP

    Args:
        logdir: A run's directory, or a directory of runs.
        runs: As :func:`load`.
        tensors: A tensor's name or a glob, or a list of them; every histogram (another
            writer's too) by default. One without a ``/`` is matched against the qualified
            name of layerwatch's histograms (the tag less its family, so a parameter's
            ``weights/`` and ``grads/`` histograms both, and a module's ``activations/``); one
            with a ``/`` against the whole tag, the ``tensor`` column
            (``"grads/transformer.h.*"``).
        steps: The steps to read: a list (or any iterable) of step numbers, a ``range``, or a
            ``slice`` read as the range it spells, with an open end allowed
            (``slice(1000, None)``: step 1000 on); every step by default.

    Raises:
        ImportError, FileNotFoundError, ValueError: as :func:`load`.
        TypeError: ``tensors`` or ``steps`` of another type, or holding one (a bare int for
            ``steps`` among them: ``[100]`` is step 100, ``range(100)`` the steps before it).
        ValueError: ``tensors`` or ``steps`` that choose nothing or hold a negative step, or
            ``tensors`` that match none of layerwatch's histograms at the steps read (the
            message lists some).
    """
    pd = _pandas()
    chosen, at = _TensorFilter.of(tensors), chosen_steps(steps)
    frames = []
    for name, files in _select(logdir, runs).items():
        latest: dict[tuple[str, int], tuple[float, Any]] = {}
        with E.Cut() as cut:
            for data in E.records_of(files, cut):
                for wall, step, value in _histograms(data, chosen, at):
                    _keep_later(latest, (value.tag, step), wall, value.histo)
        if latest:
            frames.append(_histogram_frame(pd, name, sorted(latest.items(), key=lambda item: (item[0][1], item[0][0]))))
    if chosen is not None and not frames:
        chosen.check_found(logdir)
    return _concat(pd, frames, HISTOGRAM_COLUMNS, {"step": np.int64, "bucket": np.int64})


def load_alerts(logdir: str | os.PathLike, runs: Runs = None) -> "pd.DataFrame":
    """Every alert under ``logdir``, one row each, at the step it was raised, with the first
    offender (``kind="first_offender"``, its layer, and what it did) and the sentinel's first
    non-finite step (``kind="first_nonfinite_step"``) among them.

    Raises: as :func:`load`.
    """
    pd = _pandas()
    rows: list[tuple[str, int, str, str, str]] = []
    for name, scan in _scan_runs(logdir, runs).items():
        found: dict[tuple[int, str, str, str], None] = {}
        for step, event in scan.tab.events:
            for kind, value in event.items():
                for row in _alert_rows(step, kind, value):
                    found.setdefault(row)
        if not found and scan.alerts_text is not None:  # a log written before the tab's events
            from layerwatch.health.alert import parse_alerts_markdown

            for alert in parse_alerts_markdown(scan.alerts_text[1]):
                found.setdefault((alert.step, alert.kind, alert.name, alert.message))
        rows += [(name, *row) for row in sorted(found, key=lambda r: (r[0], r[1] != "first_nonfinite_step"))]
    frame = pd.DataFrame(rows, columns=ALERT_COLUMNS)
    return frame.astype({"step": np.int64})


def load_experts(logdir: str | os.PathLike, runs: Runs = None) -> "pd.DataFrame":
    """The load of every Mixture-of-Experts router under ``logdir``, one row per (run, step,
    layer, expert): ``layer`` is the router module's name (as in :func:`load`), ``tokens`` the
    tokens routed to the expert at that sampled step (a token counts once for each expert it is
    sent to), ``share`` the expert's share of its router's tokens at that step (they sum to 1
    over a router's experts; NaN where the router routed none), and ``bias`` the router's
    aux-free balancing bias for the expert (DeepSeek-V3's ``e_score_correction_bias``; NaN for
    a router without one).

        >>> import layerwatch
        >>> experts = layerwatch.load_experts("runs")                    # doctest: +SKIP
        >>> last = experts[experts.step == experts.step.max()]           # doctest: +SKIP
        >>> last.pivot_table("share", "layer", "expert")                 # doctest: +SKIP
        >>> experts[experts.tokens == 0].groupby(["layer", "expert"]).step.min()  # doctest: +SKIP

    The second line gives the routers x experts grid of shares at the last sample (the
    LAYERWATCH tab's experts view); the third, each dead expert's first step without a token.

    Args:
        logdir, runs: As :func:`load`.

    Raises:
        ImportError, FileNotFoundError: as :func:`load`.
        ValueError: as :func:`load`, or no chosen run has a router's data (the ``moe`` family
            measures transformers' MoE routers, and a custom MoE's named by ``moe_routers``).
    """
    pd = _pandas()
    frames = []
    scans = _scan_runs(logdir, runs)
    for name, scan in scans.items():
        experts = experts_of(scan.tab)
        if experts is not None:
            frames.append(_experts_frame(pd, name, experts))
    if not frames:
        raise ValueError(f"no Mixture-of-Experts router in the runs of {str(logdir)!r} ({', '.join(scans)}): no "
                         f"{V.MOE_TOKENS} series (the moe family measures transformers' MoE routers, and a custom "
                         "MoE's named by moe_routers)")
    return _concat(pd, frames, EXPERT_COLUMNS, {})


def _experts_frame(pd: Any, run: str, experts: Any) -> "pd.DataFrame":
    """``experts`` (a :class:`~layerwatch.reading.experts.Experts`) as rows, step by step, each
    step's routers in model order."""
    step_at, row_at = np.nonzero(np.isfinite(experts.tokens.T))
    bias = experts.bias[row_at, step_at] if experts.bias is not None else np.full(row_at.size, np.nan)
    return pd.DataFrame({
        "run": run, "step": np.asarray(experts.steps, dtype=np.int64)[step_at],
        "layer": np.asarray(experts.routers, dtype=object)[experts.router[row_at]],
        "expert": experts.expert[row_at],
        "tokens": experts.tokens[row_at, step_at],
        "share": experts.shares()[row_at, step_at],
        "bias": np.where(np.isneginf(bias), np.nan, bias),
    })


def _alert_rows(step: int, kind: str, value: Any) -> Iterator[tuple[int, str, str, str]]:
    if kind == "alerts":
        for alert in value:
            yield int(alert["step"]), alert["kind"], alert["layer"], alert["message"]
    elif kind == "first_offender":
        yield int(value["step"]), "first_offender", value["layer"], value["text"]
    elif kind == "first_nonfinite_step":
        yield int(value), "first_nonfinite_step", "", f"NaN/Inf gradients first found by the sentinel at step {int(value)}"


# ---------------------------------------------------------------------- reading


@dataclass
class _Scan:
    """What :func:`_scan` keeps of one run."""

    tab: Reader = field(default_factory=Reader)
    run_wide: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # tag -> step -> (wall, value)
    per_layer_cards: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # only without the tab
    alerts_text: Optional[tuple[int, str]] = None
    layerwatch: bool = False

    def cards(self) -> dict[str, dict[int, tuple[float, float]]]:
        return {} if self.tab.keys() else self.per_layer_cards


def _scan_runs(logdir: str | os.PathLike, runs: Runs) -> dict[str, _Scan]:
    scans = {}
    with E.Cut() as cut:
        for name, files in _select(logdir, runs).items():
            scans[name] = _scan(files, cut)
    if not any(scan.layerwatch for scan in scans.values()):
        raise ValueError(f"no layerwatch data under {str(logdir)!r}; runs found: {', '.join(scans)}")
    return {name: scan for name, scan in scans.items() if scan.layerwatch}


def _scan(files: list[Path], cut: E.Cut) -> _Scan:
    """The tab's data, the run-wide scalars and the alerts of one run, decoding only the values
    whose tag starts with ``layerwatch/`` (and, in a log without the tab's data, its cards)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    scan = _Scan()
    for data in E.records_of(files, cut):
        head = E.head(data)
        if head is None:  # not the layout this reader expects: parse it all
            event = E.event(data)
            values: Iterable[Any] = event.summary.value
            wall, step = event.wall_time, event.step
        else:
            wall, step = head
            values = [Summary.Value.FromString(data[start:end]) for _, start, end in E.values(data, (_MARK,))]
        for value in values:
            _keep(scan, wall, step, value)
    if not scan.tab.keys():  # a log written before the tab existed: its cards, parsed whole
        for data in E.records_of(files, cut):
            event = E.event(data)
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value" and value.tag.startswith(CARD_PREFIXES) \
                        and not value.tag.startswith(V.RUN_WIDE):
                    _keep_later(scan.per_layer_cards.setdefault(value.tag, {}), event.step, event.wall_time,
                                value.simple_value)
                    scan.layerwatch = True
    return scan


def _keep(scan: _Scan, wall: float, step: int, value: Any) -> None:
    tag = value.tag
    if not tag.startswith(V.RUN_WIDE):
        return
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        _keep_later(scan.run_wide.setdefault(tag, {}), step, wall, value.simple_value)
        scan.layerwatch = True
    elif kind == "tensor" and tag.startswith((V.SERIES, V.LAYOUT, V.EVENTS)):
        scan.tab.add_tensor(step, wall, tag, value.tensor)
        scan.layerwatch = True
    elif kind == "tensor" and tag == V.ALERTS_TEXT and value.tensor.string_val:
        if scan.alerts_text is None or step >= scan.alerts_text[0]:
            scan.alerts_text = (step, value.tensor.string_val[0].decode("utf-8", "replace"))
        scan.layerwatch = True


def _histograms(data: bytes, tensors: Optional["_TensorFilter"], steps: Optional[Container[int]]
                ) -> Iterator[tuple[float, int, Any]]:
    """``(wall_time, step, Summary.Value)`` of each chosen histogram of one record. A record of
    a step not in ``steps`` is passed over by its head; with ``tensors``, only the values whose
    tag it chooses are parsed, found by :func:`~layerwatch.reading.events.values`."""
    head = E.head(data)
    if head is not None and steps is not None and head[1] not in steps:
        return
    if head is None or tensors is None:  # every writer's histograms, or a layout of its own: parse it all
        event = E.event(data)
        if steps is None or event.step in steps:
            for value in event.summary.value:
                if value.HasField("histo") and (tensors is None or tensors.chooses(value.tag.encode())):
                    yield event.wall_time, event.step, value
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    wall, step = head
    for _, start, end in E.values(data, tensors.marks, tensors.chooses):
        value = Summary.Value.FromString(data[start:end])
        if value.HasField("histo"):
            yield wall, step, value


def _keep_later(kept: dict[Any, tuple[float, Any]], key: Any, wall: float, value: Any) -> None:
    """``kept[key] = (wall, value)`` unless a later write of ``key`` is kept already: a step
    written twice (a resumed run) keeps its later values."""
    if key not in kept or kept[key][0] <= wall:
        kept[key] = (wall, value)


def _select(logdir: str | os.PathLike, runs: Runs) -> dict[str, list[Path]]:
    """The chosen runs' event files, by run name."""
    root = Path(logdir)
    if not root.exists():
        raise FileNotFoundError(f"log directory {str(root)!r} does not exist")
    try:
        found = find_runs(root)
    except ReportError as e:
        raise ValueError(str(e)) from None
    if runs is None:
        return found
    patterns = [runs] if isinstance(runs, str) else list(runs) if isinstance(runs, (list, tuple)) else [runs]
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"runs must be a run's name, a list of names or a glob, got {runs!r}")
    chosen = {name: files for name, files in found.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)}
    if not chosen:
        raise ValueError(f"no run under {str(root)!r} matches runs={runs!r}; runs found: {', '.join(found)}")
    return chosen


# ---------------------------------------------------------------------- choosing histograms


class _TensorFilter:
    """The histograms ``tensors=`` chooses (see :func:`load_histograms`), and ``marks``: the tag
    prefixes a record is scanned for. What it decided is kept by tag (``seen``): a run's tags
    come back at every step."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        by_name = [p for p in patterns if "/" not in p]
        by_tag = [p for p in patterns if "/" in p]
        self._name, self._tag = _globs(by_name), _globs(by_tag)
        marks = set(_HISTOGRAM_MARKS) if by_name else set()
        for pattern in by_tag:
            family = pattern.partition("/")[0]
            marks.update(_HISTOGRAM_MARKS if _is_glob(family) else [f"{family}/".encode()])
        self.marks = tuple(sorted(marks))
        self.seen: dict[bytes, bool] = {}

    @classmethod
    def of(cls, tensors: Tensors) -> Optional["_TensorFilter"]:
        """The filter of ``tensors`` (None: every histogram).

        Raises:
            TypeError: ``tensors`` is not a string or an iterable of strings, naming what is not.
            ValueError: ``tensors`` is empty or holds an empty string.
        """
        if tensors is None:
            return None
        if isinstance(tensors, str):
            patterns = [tensors]
        elif isinstance(tensors, (bytes, bytearray)) or not isinstance(tensors, Iterable):
            raise TypeError(f"tensors must be a tensor's name or a glob, or a list of them; got {tensors!r}")
        else:
            patterns = list(tensors)
        for pattern in patterns:
            if not isinstance(pattern, str):
                raise TypeError(f"tensors must hold tensor names or globs (strings); got {pattern!r} "
                                f"({type(pattern).__name__}) in {tensors!r}")
            if not pattern:
                raise ValueError(f"tensors holds an empty name: {tensors!r}")
        if not patterns:
            raise ValueError(f"tensors={tensors!r} chooses no histogram; leave it out (None) for every one")
        return cls(patterns)

    def chooses(self, tag: bytes) -> bool:
        """Whether the histogram tagged ``tag`` (its UTF-8 bytes) is chosen."""
        chosen = self.seen.get(tag)
        if chosen is None:
            text = tag.decode("utf-8", "replace")
            by_name = tag.startswith(_HISTOGRAM_MARKS) and self._name is not None \
                and self._name.match(text.partition("/")[2]) is not None
            chosen = self.seen[tag] = by_name or (self._tag is not None and self._tag.match(text) is not None)
        return chosen

    def check_found(self, logdir: str | os.PathLike) -> None:
        """Raises ValueError when histograms were read and none was chosen, listing some of them
        (a misspelt name otherwise reads as an empty table)."""
        found = sorted(tag.decode("utf-8", "replace") for tag in self.seen if tag.startswith(_HISTOGRAM_MARKS))
        if found and not any(self.seen.values()):
            more = f" and {len(found) - 5:,} more" if len(found) > 5 else ""
            shown = self.patterns[0] if len(self.patterns) == 1 else self.patterns
            raise ValueError(f"no histogram under {str(logdir)!r} matches tensors={shown!r}; its histograms are "
                             f"{', '.join(found[:5])}{more}")


def _globs(patterns: list[str]) -> Optional["re.Pattern[str]"]:
    """One regular expression matching what any of the globs ``patterns`` matches (as
    :func:`fnmatch.fnmatchcase` does), or None for no pattern."""
    return re.compile("|".join(fnmatch.translate(p) for p in patterns)) if patterns else None


def _is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def chosen_steps(steps: Steps) -> Optional[Container[int]]:
    """The steps ``steps=`` chooses (see :func:`load_histograms`), as a set or a range (a
    slice's open end runs to ``sys.maxsize``); None for every step.

    Raises:
        TypeError: ``steps`` is not an iterable of ints, a range or a slice (a bare int is
            refused: it could mean the step or the steps before it), naming what is not.
        ValueError: ``steps`` chooses no step or holds a negative one, or a slice's step is below 1.
    """
    if steps is None:
        return None
    if isinstance(steps, Integral):
        raise TypeError(f"steps must be a list of step numbers, a range or a slice, got {steps!r}: "
                        f"for step {steps} alone pass [{steps}]; for the steps before it, range({steps})")
    if isinstance(steps, slice):
        bounds = (steps.start, steps.stop, steps.step)
        bad = next((b for b in bounds if b is not None and (isinstance(b, bool) or not isinstance(b, Integral))), None)
        if bad is not None:
            raise TypeError(f"steps={steps!r}: a slice of step numbers takes ints or None, got {bad!r}")
        if steps.step is not None and steps.step < 1:
            raise ValueError(f"steps={steps!r}: the slice's step must be >= 1")
        chosen: Container[int] = range(int(steps.start or 0), sys.maxsize if steps.stop is None else int(steps.stop),
                                       int(steps.step or 1))
        least = min((b for b in bounds[:2] if b is not None), default=0)
    elif isinstance(steps, range):
        chosen, least = steps, min(steps[0], steps[-1]) if steps else 0
    elif isinstance(steps, (str, bytes, bytearray)) or not isinstance(steps, Iterable):
        raise TypeError(f"steps must be a list of step numbers, a range or a slice, got {steps!r}")
    else:
        numbers = list(steps)
        bad = next((n for n in numbers if isinstance(n, bool) or not isinstance(n, Integral)), None)
        if bad is not None:
            raise TypeError(f"steps must hold step numbers (ints); got {bad!r} ({type(bad).__name__})")
        chosen = frozenset(int(n) for n in numbers)
        least = min(chosen, default=0)
    if least < 0:
        raise ValueError(f"steps={steps!r} holds a negative step ({least}); steps are numbered from 0, and a "
                         "negative one does not count from the end")
    if not chosen:
        raise ValueError(f"steps={steps!r} chooses no step; leave it out (None) for every one")
    return chosen


# ---------------------------------------------------------------------- frames


def _series_frame(pd: Any, run: str, key: str, layers: list[str], steps: Sequence[int], matrix: np.ndarray) -> "pd.DataFrame":
    """One series' layers x steps (-inf: not measured) as rows, layer by layer."""
    layer_at, step_at = np.nonzero(matrix != -np.inf)
    return pd.DataFrame({
        "run": run, "step": np.asarray(steps, dtype=np.int64)[step_at], "series": key,
        "layer": np.asarray(layers, dtype=object)[layer_at],
        "value": matrix[layer_at, step_at].astype(np.float64),
    })


def _histogram_frame(pd: Any, run: str, histograms: list[tuple[tuple[str, int], tuple[float, Any]]]) -> "pd.DataFrame":
    """The buckets of ``histograms`` (``((tag, step), (wall, HistogramProto))``) as rows, built
    from one array per column."""
    limits = [np.asarray(h.bucket_limit, dtype=np.float64) for _, (_, h) in histograms]
    sizes = np.array([len(x) for x in limits], dtype=np.int64)
    mins = np.array([h.min for _, (_, h) in histograms], dtype=np.float64)
    right = np.concatenate(limits) if limits else np.empty(0)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    left = np.empty_like(right)
    left[1:] = right[:-1]  # a bucket's left edge is the one before it's right edge ...
    has_buckets = sizes > 0
    left[first[has_buckets]] = mins[has_buckets]  # ... and a histogram's first bucket starts at its min
    return pd.DataFrame({
        "run": run,
        "step": np.repeat(np.array([step for (_, step), _ in histograms], dtype=np.int64), sizes),
        "tensor": np.repeat(np.array([tag for (tag, _), _ in histograms], dtype=object), sizes),
        "bucket": np.arange(len(right), dtype=np.int64) - np.repeat(first, sizes),
        "left": left, "right": right,
        "count": np.concatenate([np.asarray(h.bucket, dtype=np.float64) for _, (_, h) in histograms]),
        "min": np.repeat(mins, sizes),
        "max": np.repeat(np.array([h.max for _, (_, h) in histograms], dtype=np.float64), sizes),
        "num": np.repeat(np.array([h.num for _, (_, h) in histograms], dtype=np.float64), sizes),
    })


def _card_matrix(tag: str, by_step: dict[int, tuple[float, float]]) -> tuple[str, list[str], list[int], np.ndarray]:
    key, _, layer = tag.partition("/")
    steps = sorted(by_step)
    return key, [layer], steps, np.asarray([[by_step[s][1] for s in steps]], dtype=np.float32)


def _concat(pd: Any, frames: list, columns: list[str], dtypes: dict[str, Any]) -> "pd.DataFrame":
    if not frames:
        return pd.DataFrame({name: pd.Series(dtype=dtypes.get(name, object)) for name in columns})
    return pd.concat(frames, ignore_index=True)[columns]


def _pandas() -> Any:
    try:
        import pandas as pd
    except ImportError as e:
        raise ImportError('layerwatch.load needs pandas: pip install "layerwatch[pandas]"') from e
    return pd
