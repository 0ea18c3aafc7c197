"""Event files read back: the one reader of them, for the report, the notebook, the LAYERWATCH
tab and the share (no torch: TensorBoard's process imports the tab).

- the runs of a log directory (:func:`find_runs`) and their files' records: TFRecord records
  (:func:`records`), each an ``Event``'s bytes, parsed whole (:func:`events`, :func:`event`) or
  scanned for the values a reader wants (:func:`head`, :func:`values`: a byte scan, not a parse);
- the LAYERWATCH tab's data decoded (:func:`decode`) and reassembled into steps (:class:`Reader`).

Each record's length checksum is verified with TensorBoard's own CRC. The checksum of each
record's data is not verified: TensorBoard's reader does that in pure Python at about 8 s per
100 MB (the histograms are most of the bytes), and a damaged record fails to parse anyway. A
record cut short (a run still writing) ends the file.

The tab's data, written by :mod:`layerwatch.sinks.plugin_data`, its names
:mod:`layerwatch.vocabulary`'s: each sampled step has, as tensors owned by
the ``layerwatch`` plugin:

- ``layerwatch/series/<series>``: float32 ``[n]``, one value per layer of the series' names
  in the layout, for each per-layer series of the step (``grads_norm``, ``fwd_ms``,
  ``activation_bytes``, ...: the scalar tag's prefix before its ``/``); -inf for a layer not
  measured at that step (a module not called, a parameter without a gradient);
- ``layerwatch/layout``: a JSON string ``{"series": {series: [layer names]}}``, in the same
  event as the first step's series, and again when a series meets a layer it had not seen (the
  lists only grow, so a layer that comes and goes does not rewrite them);
- ``layerwatch/events/<kind>``: a JSON string at the step where it appears, for the kinds
  ``alerts`` (the new alerts, a list); ``first_offender`` (``layer``, ``step``, ``phase``,
  ``text``, and ``replayed_from``: the step whose batch was run again to find it, or null);
  ``first_nonfinite_step``; and ``spikes`` (the loss spikes found since the sample before, a
  list: ``step``, ``what``, ``value``, ``z``, ``mean``, ``std``, ``scale`` (``"log"``: ``z``
  and ``std`` of the logarithm, ``mean`` the geometric mean; ``"linear"``), ``over``, ``layer`` (the
  top-ranked), ``layers`` (ranked: ``layer``, ``what``, ``factor``, ``before``, ``now``),
  ``sampled_at``, ``replayed``, ``text``, ``message``); and ``rerun`` (``true``: the step's
  per-module values are of a compiled model's eager re-run): one tag each, as a step may have
  several and a time series keeps one value per step.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from layerwatch.reading.rankings import Table
from layerwatch.vocabulary import EVENTS, LAYOUT, SERIES

_WALL_TIME = struct.Struct("<d")  # Event.wall_time: a little-endian double


class ReportError(Exception):
    """The log directory cannot be reported on (missing, empty, unreadable)."""


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


def records(path: Path, on_cut: Optional[Callable[[Path, int], None]] = None) -> Iterator[tuple[int, bytes]]:
    """The records of one event file (TFRecord: each an ``Event``'s bytes) and the byte each
    starts at, in order. A record
    cut short (a run still being written, or killed) ends the file: ``on_cut(path, offset)``
    is told. A length whose checksum fails ends it too, with a warning."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    with open(path, "rb") as f:
        while True:
            header = f.read(12)  # uint64 length, uint32 masked CRC of the length
            if not header:
                return
            if len(header) < 12:
                if on_cut is not None:
                    on_cut(path, f.tell() - len(header))
                return
            length, length_crc = struct.unpack("<QI", header)
            if masked_crc32c(header[:8]) != length_crc:
                warnings.warn(f"layerwatch: {path} is damaged after {f.tell() - 12} bytes; read up to there")
                return
            start = f.tell() - 12
            data = f.read(length)
            if len(f.read(4)) < 4 or len(data) < length:
                if on_cut is not None:
                    on_cut(path, start)
                return
            yield start, data


def events(path: Path) -> Iterator[Any]:
    """The ``Event`` protos of one event file, in order (a damaged record skipped)."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event

    for start, data in records(path):
        try:
            yield Event.FromString(data)
        except DecodeError:
            warnings.warn(f"layerwatch report: {path} has a damaged record at byte {start}; skipped")


def head(data: bytes) -> Optional[tuple[float, int]]:
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


def values(data: bytes, marks: tuple[bytes, ...], wanted: Optional[Callable[[bytes], bool]] = None
            ) -> Iterator[tuple[bytes, int, int]]:
    """The tag, and where its serialized ``Summary.Value`` starts and ends in ``data``, of each
    value of an event whose tag starts with one of ``marks`` (and, with ``wanted``, that it
    wants): found by a byte scan for each mark, then checked against the bytes before it
    (``Value``'s key and length, the tag's key and length). An unwanted tag is passed over on
    its own bytes, before that check."""
    for mark in marks:
        at = data.find(mark)
        while at >= 0:
            # A key then a one-byte length before the mark: the only tag the check could confirm.
            if wanted is not None and at >= 2 and data[at - 2] == 0x0A and not wanted(data[at:at + data[at - 1]]):
                at = data.find(mark, at + 1)
                continue
            piece = _value_at(data, at)
            if piece is None:
                at = data.find(mark, at + 1)
                continue
            start, tag_end, end = piece
            if wanted is None or wanted(data[at:tag_end]):
                yield data[at:tag_end], start, end
            at = data.find(mark, end)


def _value_at(data: bytes, tag_at: int) -> Optional[tuple[int, int, int]]:
    """The ``Summary.Value`` whose tag starts at ``tag_at``: where the value starts, where its
    tag ends and where the value ends; None when the bytes before it are not a value's key,
    length, tag key and tag length."""
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
            if length is not None and tag_at + tag_len <= tag_key + length <= len(data):
                return tag_key, tag_at + tag_len, tag_key + length
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


def event(data: bytes) -> Any:
    from tensorboard.compat.proto.event_pb2 import Event

    return Event.FromString(data)


def records_of(files: list[Path], cut: "Cut") -> Iterator[bytes]:
    for path in files:
        for _, data in records(path, on_cut=cut.note):
            yield data


class Cut:
    """Collects the files cut short within one call, and says so once."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def note(self, path: Path, at: int) -> None:
        self.paths.append(f"{path} (at byte {at})")

    def __enter__(self) -> "Cut":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.paths and exc[0] is None:
            warnings.warn(f"layerwatch.load: {len(self.paths)} event file(s) end in a record cut short (a run still "
                          f"being written, or killed); read up to there: {', '.join(sorted(set(self.paths)))}",
                          RuntimeWarning, stacklevel=3)


def decode_text(value: Any) -> Any:
    """A ``layout`` or ``events`` tensor (a NumPy array from the data provider, or a
    ``TensorProto``) as the JSON it holds."""
    if hasattr(value, "tensor_content"):
        raw = value.string_val[0]
    else:
        raw = np.asarray(value).item()
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def decode_floats(value: Any) -> np.ndarray:
    """A ``series`` tensor (NumPy array or ``TensorProto``) as a float32 array."""
    if hasattr(value, "tensor_content"):
        return np.frombuffer(value.tensor_content, dtype="<f4")
    return np.asarray(value, dtype=np.float32).reshape(-1)


def decode(tag: str, value: Any) -> Any:
    """One of the tab's tensors as the Reader takes it: JSON for layouts and events, a float32
    array for series."""
    return decode_floats(value) if tag.startswith(SERIES) else decode_text(value)


class Reader:
    """Reassembles steps from the tab's tensors: feed it ``(step, wall_time, tag, value)`` in
    any order with :meth:`add` (values decoded by :func:`decode`), then read :meth:`series`.

    A step's values are read with the last layout written before them (by wall time, so a run
    resumed into the same directory, writing steps again, reads each step with its own
    layout). A step written twice keeps its later values.
    """

    def __init__(self) -> None:
        self._layouts: list[tuple[float, dict[str, list[str]]]] = []
        self._values: dict[str, dict[int, tuple[float, np.ndarray]]] = {}
        self.events: list[tuple[int, dict[str, Any]]] = []

    def add(self, step: int, wall_time: float, tag: str, value: Any) -> None:
        if tag == LAYOUT:
            self._layouts.append((wall_time, value["series"]))
        elif tag.startswith(EVENTS):
            self.events.append((step, {tag[len(EVENTS) :]: value}))
        elif tag.startswith(SERIES):
            by_step = self._values.setdefault(tag[len(SERIES) :], {})
            if step not in by_step or by_step[step][0] <= wall_time:
                by_step[step] = (wall_time, value)

    def add_tensor(self, step: int, wall_time: float, tag: str, tensor: Any) -> None:
        """:meth:`add` of a tensor as written (a ``TensorProto`` or NumPy array)."""
        self.add(step, wall_time, tag, decode(tag, tensor))

    def layout_sizes(self) -> dict[str, int]:
        """Each series' number of layers in the latest layout."""
        return {key: len(names) for key, names in self._latest_layout().items()}

    def _latest_layout(self) -> dict[str, list[str]]:
        return max(self._layouts, key=lambda item: item[0])[1] if self._layouts else {}

    def keys(self) -> list[str]:
        return list(self._values)

    def steps(self) -> list[int]:
        return sorted({step for by_step in self._values.values() for step in by_step})

    def series(self, key: str) -> dict[int, tuple[list[str], np.ndarray]]:
        """``{step: (names, values)}`` of one series; a step whose layout is missing (a
        damaged or down-sampled log) or does not match its values is left out. A value of
        -inf: that layer was not measured at that step."""
        layouts = sorted(self._layouts, key=lambda item: item[0])
        walls = [wall for wall, _ in layouts]
        out = {}
        for step, (wall, values) in sorted(self._values.get(key, {}).items()):
            at = bisect.bisect_right(walls, wall) - 1
            names = layouts[at][1].get(key) if at >= 0 else None
            if names is not None and len(names) == values.size:
                out[step] = (names, values)
        return out

    def matrix(self, key: str) -> tuple[list[str], list[int], np.ndarray]:
        """One series as layers x steps (float32; -inf where a layer has no value at a step,
        NaN where its statistic was NaN), layers in the order of the latest layout."""
        series = self.series(key)
        steps = sorted(series)
        rows: dict[str, int] = {}
        seen: set[int] = set()  # the steps of one layout share its list of names
        for names in [self._latest_layout().get(key, []), *(names for names, _ in series.values())]:
            if id(names) not in seen:
                seen.add(id(names))
                for name in names:
                    rows.setdefault(name, len(rows))
        matrix = np.full((len(rows), len(steps)), -np.inf, dtype="<f4")
        index_of: dict[int, np.ndarray] = {}  # one index array per distinct names list
        for column, step in enumerate(steps):
            names, values = series[step]
            index = index_of.get(id(names))
            if index is None:
                index = index_of[id(names)] = np.array([rows[name] for name in names], dtype=np.int64)
            matrix[index, column] = values
        return list(rows), steps, matrix

    def table(self, key: str) -> Table:
        """One series as a :class:`~layerwatch.reading.rankings.Table` (NaN: no finite value)."""
        names, steps, matrix = self.matrix(key)
        values = matrix.astype(np.float64)  # a factor of two float32 norms can pass float32's range
        return Table(names, np.asarray(steps, dtype=np.int64), np.where(np.isfinite(values), values, np.nan))
