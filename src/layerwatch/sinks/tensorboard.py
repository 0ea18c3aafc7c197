"""Writes step records to a TensorBoard ``SummaryWriter``: one event per sampled step.

Each step's scalars, histograms and texts are encoded here as one ``Summary`` (bytes, not
thousands of proto objects: protobuf's upb runtime calls ``malloc_trim(0)`` after every
10,000 freed arena blocks, which hands a CPU training step's cached memory back to the OS
and makes the next step pay for it in page faults). The event is appended to the writer's
own event file with a C CRC32C (:mod:`layerwatch.sinks.event_file`), so it lands in the same run
as the rest of what the writer holds; without the C CRC it goes through the writer's
``add_event`` and is flushed, so its pure-Python CRC runs in the sampled step and not in the
steps after it.

Not every scalar becomes a card (:class:`~layerwatch.sinks.record.CardFilter`); all of them, with
the step's alerts, go into the same event as the LAYERWATCH tab's compact data
(:mod:`layerwatch.sinks.plugin_data`).

Any other writer with the ``SummaryWriter`` interface (e.g. tensorboardX) gets every scalar as
a card, value by value through its public methods (texts only if it has ``add_text``): it
cannot carry the tab's data, so nothing is held back from its cards.
"""

from __future__ import annotations

import functools
import struct
import time
from typing import Any

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard import summary as builders

from layerwatch.sinks.record import CardFilter, StepRecord
from layerwatch.sinks import event_file as events
from layerwatch.sinks.plugin_data import PluginData
from layerwatch.stats import Histogram


class TensorBoardSink:
    """Writes to ``writer``; closes it on ``close()`` only when ``owns_writer``."""

    def __init__(self, writer: Any, *, owns_writer: bool) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self._batched = isinstance(writer, SummaryWriter)
        self._tag_fields: dict[str, bytes] = {}
        self._cards = CardFilter()
        self._plugin = PluginData()

    def write(self, record: StepRecord) -> None:
        for tag, points in record.history.items():  # earlier steps' values (a spike's lead-up): rare, before the step's
            for step, value in points:
                self.writer.add_scalar(tag, value, step)
        if self._batched:
            summary = encode_summary(record, self._tag_fields, self._cards(record.scalars)) + self._plugin.encode(record)
            if events.append(self.writer, [events.event(time.time(), record.step, summary)]):
                return
            event = Event.FromString(events.field(5, summary))  # Event.summary
            self.writer._get_file_writer().add_event(event, record.step)
        else:
            for tag, v in record.scalars.items():
                self.writer.add_scalar(tag, v, record.step)
            for tag, h in record.histograms.items():
                self.writer.add_histogram_raw(
                    tag, h.min, h.max, h.num, h.sum, h.sum_squares, h.bucket_limits, h.bucket_counts, record.step
                )
            if hasattr(self.writer, "add_text"):
                for tag, text in record.texts.items():
                    self.writer.add_text(tag, text, record.step)
        self.writer.flush()

    def write_layout(self, layout: dict) -> None:
        if self._batched:
            self.writer._get_file_writer().add_summary(builders.custom_scalars(layout))
        else:
            self.writer.add_custom_scalars(layout)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self.owns_writer:
            self.writer.close()
        else:
            self.writer.flush()


# Protobuf wire format of tensorboard/compat/proto/summary.proto:
#   Summary { repeated Value value = 1; }
#   Value { string tag = 1; float simple_value = 2; HistogramProto histo = 5; }
#   HistogramProto { double min = 1; double max = 2; double num = 3; double sum = 4;
#                    double sum_squares = 5; repeated double bucket_limit = 6 [packed];
#                    repeated double bucket = 7 [packed]; }
_HISTO_HEAD = struct.Struct("<BdBdBdBdBd")


def encode_summary(
    record: StepRecord, tag_fields: dict[str, bytes] | None = None, scalars: dict[str, float] | None = None
) -> bytes:
    """The serialized ``Summary`` holding ``record``'s scalars (or ``scalars``), histograms and texts.

    Texts are rare (the layer table, once), so they are built by torch's own builder;
    serialized ``Summary`` messages concatenate into one. ``tag_fields`` caches each tag's
    encoded field between calls (the same tags come back every sampled step).
    """
    cache = {} if tag_fields is None else tag_fields
    scalars = record.scalars if scalars is None else scalars
    values = [_scalar_block(tuple(scalars)).encode(np.fromiter(scalars.values(), dtype="<f4", count=len(scalars)))]
    values += _histogram_values(cache, record.histograms)
    values += [builders.text(tag, text).SerializeToString() for tag, text in record.texts.items()]
    return b"".join(values)


class _ScalarBlock:
    """The ``Summary.value`` entries of a fixed list of scalar tags, encoded once as a template:
    the floats of a step go into their places in one vectorized assignment."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        entries = _scalar_entries(tags)
        self._template = b"".join(entries)
        ends = np.cumsum([len(entry) for entry in entries], dtype=np.intp)
        self._places = (ends - 4)[:, None] + np.arange(4)

    def encode(self, floats: np.ndarray) -> bytes:
        out = np.frombuffer(self._template, dtype=np.uint8).copy()
        out[self._places] = floats.view(np.uint8).reshape(-1, 4)
        return out.tobytes()


@functools.lru_cache(maxsize=8)
def _scalar_block(tags: tuple[str, ...]) -> _ScalarBlock:
    return _ScalarBlock(tags)


def _scalar_entries(tags: tuple[str, ...]) -> list[bytes]:
    """A ``Summary.value`` entry per tag: the tag (field 1), then a float32 ``simple_value`` of
    zero (field 2), in one loop (no call per tag: a sampled step's new tags are thousands)."""
    out, varint = [], events.varint
    for tag in tags:
        key = tag.encode()
        head = b"\x0a" + varint(len(key)) + key
        out.append(b"\x0a" + varint(len(head) + 5) + head + b"\x15" + bytes(4))
    return out


def _histogram_values(cache: dict[str, bytes], histograms: dict[str, Histogram]) -> list[bytes]:
    """The ``Summary.value`` entries of ``histograms``: each ``HistogramProto`` in field 5 (one loop,
    no call per histogram: a sampled step writes two or three per parameter)."""
    out, pack, varint, asarray = [], _HISTO_HEAD.pack, events.varint, np.asarray
    for tag, h in histograms.items():
        head = cache.get(tag)
        if head is None:  # the tag (field 1)
            key = tag.encode()
            head = cache[tag] = b"\x0a" + varint(len(key)) + key
        limits, counts = asarray(h.bucket_limits, dtype=_F8).tobytes(), asarray(h.bucket_counts, dtype=_F8).tobytes()
        size = varint(len(limits))
        fields = pack(1 << 3 | 1, h.min, 2 << 3 | 1, h.max, 3 << 3 | 1, h.num, 4 << 3 | 1, h.sum, 5 << 3 | 1, h.sum_squares)
        body = b"".join((fields, b"\x32", size, limits, b"\x3a", size, counts))
        rest = b"\x2a" + varint(len(body)) + body
        out.append(b"\x0a" + varint(len(head) + len(rest)) + head + rest)
    return out


_F8 = np.dtype("<f8")
