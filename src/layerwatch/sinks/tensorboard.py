"""Writes step records to a TensorBoard ``SummaryWriter``: one event per sampled step.

``SummaryWriter`` queues each event through a queue of ``max_queue`` (10) entries, so a
thousand small events per step wait on its lock. With torch's writer we encode all of a
step's scalars and histograms as one ``Summary`` and hand one ``Event`` to the file
writer, then flush, so the writer's (pure-Python CRC) work lands in the sampled step and
never in the steps after it.

The ``Summary`` bytes are encoded here rather than built from thousands of proto
objects: protobuf's upb runtime calls ``malloc_trim(0)`` after every 10,000 freed arena
blocks. That hands the allocator's free memory (a CPU training step's cached
activations) back to the OS, and the next training step pays for it in page faults:
+20% on the 400-tensor benchmark when every sampled step built ~1,600 proto objects.
Parsing the encoded step once costs a handful of blocks.

Any other writer with the ``SummaryWriter`` interface (e.g. tensorboardX) gets the same
data value by value through its public methods (texts only if it has ``add_text``).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard import summary as builders

from layerwatch.record import StepRecord
from layerwatch.stats import Histogram


class TensorBoardSink:
    """Writes to ``writer``; closes it on ``close()`` only when ``owns_writer``."""

    def __init__(self, writer: Any, *, owns_writer: bool) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self._batched = isinstance(writer, SummaryWriter)

    def write(self, record: StepRecord) -> None:
        if self._batched:
            event = Event.FromString(_message_field(5, encode_summary(record)))  # Event.summary
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
_FLOAT_FIELD_2 = bytes([2 << 3 | 5])
_HISTO_HEAD = struct.Struct("<BdBdBdBdBd")


def encode_summary(record: StepRecord) -> bytes:
    """The serialized ``Summary`` holding all of ``record``'s scalars, histograms and texts.

    Texts are rare (the layer table, once), so they are built by torch's own builder;
    serialized ``Summary`` messages concatenate into one.
    """
    values = [
        _message_field(1, _message_field(1, tag.encode()) + _FLOAT_FIELD_2 + struct.pack("<f", v))
        for tag, v in record.scalars.items()
    ]
    values += [
        _message_field(1, _message_field(1, tag.encode()) + _message_field(5, _encode_histogram(h)))
        for tag, h in record.histograms.items()
    ]
    values += [builders.text(tag, text).SerializeToString() for tag, text in record.texts.items()]
    return b"".join(values)


def _encode_histogram(h: Histogram) -> bytes:
    head = _HISTO_HEAD.pack(1 << 3 | 1, h.min, 2 << 3 | 1, h.max, 3 << 3 | 1, h.num, 4 << 3 | 1, h.sum, 5 << 3 | 1, h.sum_squares)
    limits = np.asarray(h.bucket_limits, dtype="<f8").tobytes()
    counts = np.asarray(h.bucket_counts, dtype="<f8").tobytes()
    return head + _message_field(6, limits) + _message_field(7, counts)


def _message_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): key, length, payload."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
