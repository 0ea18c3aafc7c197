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

A run is a directory holding event files, named by its path relative to ``logdir`` (``"."``
for ``logdir`` itself), as TensorBoard names it. Several event files in one directory (a
resumed run) read as one run: a step written twice keeps its later values.

The files are read with the project's own record reader (:func:`layerwatch.report.records`), and
for :func:`load` and :func:`load_alerts` only the values whose tag starts with
``layerwatch/`` are decoded: they are found in each record's bytes, so the cards and
histograms around them cost a byte scan, not a parse.
"""

from __future__ import annotations

import fnmatch
import os
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from layerwatch import vocabulary as V
from layerwatch.report import CARD_PREFIXES, ReportError, find_runs, records
from layerwatch.tensorboard_plugin.metadata import Reader

if TYPE_CHECKING:
    import pandas as pd

SCALAR_COLUMNS = ["run", "step", "series", "layer", "value"]
HISTOGRAM_COLUMNS = ["run", "step", "tensor", "bucket", "left", "right", "count", "min", "max", "num"]
ALERT_COLUMNS = ["run", "step", "kind", "layer", "message"]
Runs = Union[str, Sequence[str], None]

_MARK = V.RUN_WIDE.encode()
_WALL_TIME = struct.Struct("<d")  # Event.wall_time: a little-endian double


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


def load_histograms(logdir: str | os.PathLike, runs: Runs = None) -> "pd.DataFrame":
    """Every histogram under ``logdir``, one row per (run, step, tensor, bucket): the bucket's
    ``left`` and ``right`` edges and ``count``, and the histogram's exact ``min``, ``max`` and
    ``num`` (its number of values), as TensorBoard's record holds them. The first bucket's left
    edge is the histogram's ``min``; the counts of a histogram sum to its ``num``.

    Raises: as :func:`load`.
    """
    pd = _pandas()
    frames = []
    for name, files in _select(logdir, runs).items():
        latest: dict[tuple[str, int], tuple[float, Any]] = {}
        with _Cut() as cut:
            for data in _records(files, cut):
                event = _event(data)
                for value in event.summary.value:
                    if value.HasField("histo"):
                        _keep_later(latest, (value.tag, event.step), event.wall_time, value.histo)
        if latest:
            frames.append(_histogram_frame(pd, name, sorted(latest.items(), key=lambda item: (item[0][1], item[0][0]))))
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
            from layerwatch.alerts import parse_alerts_markdown

            for alert in parse_alerts_markdown(scan.alerts_text[1]):
                found.setdefault((alert.step, alert.kind, alert.name, alert.message))
        rows += [(name, *row) for row in sorted(found, key=lambda r: (r[0], r[1] != "first_nonfinite_step"))]
    frame = pd.DataFrame(rows, columns=ALERT_COLUMNS)
    return frame.astype({"step": np.int64})


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
    with _Cut() as cut:
        for name, files in _select(logdir, runs).items():
            scans[name] = _scan(files, cut)
    if not any(scan.layerwatch for scan in scans.values()):
        raise ValueError(f"no layerwatch data under {str(logdir)!r}; runs found: {', '.join(scans)}")
    return {name: scan for name, scan in scans.items() if scan.layerwatch}


def _scan(files: list[Path], cut: "_Cut") -> _Scan:
    """The tab's data, the run-wide scalars and the alerts of one run, decoding only the values
    whose tag starts with ``layerwatch/`` (and, in a log without the tab's data, its cards)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    scan = _Scan()
    for data in _records(files, cut):
        head = _head(data)
        if head is None:  # not the layout this reader expects: parse it all
            event = _event(data)
            values: Iterable[Any] = event.summary.value
            wall, step = event.wall_time, event.step
        else:
            wall, step = head
            values = [Summary.Value.FromString(piece) for piece in _layerwatch_values(data)]
        for value in values:
            _keep(scan, wall, step, value)
    if not scan.tab.keys():  # a log written before the tab existed: its cards, parsed whole
        for data in _records(files, cut):
            event = _event(data)
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


def _keep_later(kept: dict[Any, tuple[float, Any]], key: Any, wall: float, value: Any) -> None:
    """``kept[key] = (wall, value)`` unless a later write of ``key`` is kept already: a step
    written twice (a resumed run) keeps its later values."""
    if key not in kept or kept[key][0] <= wall:
        kept[key] = (wall, value)


def _head(data: bytes) -> Optional[tuple[float, int]]:
    """``(wall_time, step)`` of an ``Event`` written as TensorBoard's writers and layerwatch's
    write it (field 1, a double, then field 2, a varint); None for any other layout."""
    if len(data) < 11 or data[0] != 0x09 or data[9] != 0x10:
        return None
    (wall,) = _WALL_TIME.unpack_from(data, 1)
    step, shift, i = 0, 0, 10
    while i < len(data):
        byte = data[i]
        step |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return wall, step
        shift += 7
    return None


def _layerwatch_values(data: bytes) -> Iterator[bytes]:
    """The serialized ``Summary.Value`` entries of an event whose tag starts with
    ``layerwatch/``: found by a byte scan for the tag, then checked against the bytes before it
    (``Value``'s key and length, the tag's key and length)."""
    at = data.find(_MARK)
    while at >= 0:
        piece = _value_at(data, at)
        if piece is not None:
            start, end = piece
            yield data[start:end]
            at = data.find(_MARK, end)
        else:
            at = data.find(_MARK, at + 1)


def _value_at(data: bytes, tag_at: int) -> Optional[tuple[int, int]]:
    """The ``Summary.Value`` bytes (start, end) whose tag starts at ``tag_at``, or None when the
    bytes before it are not a value's key, length, tag key and tag length."""
    for tag_len_size in (1, 2):
        tag_key = tag_at - tag_len_size - 1
        if tag_key < 0 or data[tag_key] != 0x0A:
            continue
        tag_len = _varint(data, tag_key + 1, tag_at)
        if tag_len is None:
            continue
        for len_size in (1, 2, 3, 4):
            key = tag_key - len_size - 1  # Summary.value: field 1, length-delimited (in Event.summary)
            if key < 0 or data[key] != 0x0A:
                continue
            length = _varint(data, key + 1, tag_key)
            if length is not None and tag_key + tag_len_size + 1 + tag_len <= tag_key + length <= len(data):
                return tag_key, tag_key + length
    return None


def _varint(data: bytes, start: int, end: int) -> Optional[int]:
    """The varint that fills ``data[start:end]`` exactly, or None."""
    value, shift = 0, 0
    for i in range(start, end):
        byte = data[i]
        if (byte < 0x80) != (i == end - 1):
            return None
        value |= (byte & 0x7F) << shift
        shift += 7
    return value if end > start else None


def _event(data: bytes) -> Any:
    from tensorboard.compat.proto.event_pb2 import Event

    return Event.FromString(data)


def _records(files: list[Path], cut: "_Cut") -> Iterator[bytes]:
    for path in files:
        for _, data in records(path, on_cut=cut.note):
            yield data


class _Cut:
    """Collects the files cut short within one call, and says so once."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def note(self, path: Path, at: int) -> None:
        self.paths.append(f"{path} (at byte {at})")

    def __enter__(self) -> "_Cut":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.paths and exc[0] is None:
            warnings.warn(f"layerwatch.load: {len(self.paths)} event file(s) end in a record cut short (a run still "
                          f"being written, or killed); read up to there: {', '.join(sorted(set(self.paths)))}",
                          RuntimeWarning, stacklevel=3)


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
