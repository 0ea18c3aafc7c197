"""Writes step records to a TensorBoard ``SummaryWriter``: one event per sampled step.

``SummaryWriter`` queues each event through a queue of ``max_queue`` (10) entries, so a
thousand small events per step wait on its lock. With torch's writer we put all of a
step's scalars and histograms in one ``Summary`` and hand it to the file writer once,
then flush, so the writer's (pure-Python CRC) work lands in the sampled step and never
in the steps after it. Any other writer with the ``SummaryWriter`` interface (e.g.
tensorboardX) gets the same data value by value through its public methods.
"""

from __future__ import annotations

from typing import Any

from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard import summary as builders

from layerwatch.record import StepRecord


class TensorBoardSink:
    """Writes to ``writer``; closes it on ``close()`` only when ``owns_writer``."""

    def __init__(self, writer: Any, *, owns_writer: bool) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self._batched = isinstance(writer, SummaryWriter)

    def write(self, record: StepRecord) -> None:
        if self._batched:
            values = [Summary.Value(tag=tag, simple_value=v) for tag, v in record.scalars.items()]
            values += [
                Summary.Value(
                    tag=tag,
                    histo=HistogramProto(
                        min=h.min,
                        max=h.max,
                        num=h.num,
                        sum=h.sum,
                        sum_squares=h.sum_squares,
                        bucket_limit=h.bucket_limits,
                        bucket=h.bucket_counts,
                    ),
                )
                for tag, h in record.histograms.items()
            ]
            self.writer._get_file_writer().add_summary(Summary(value=values), record.step)
        else:
            for tag, v in record.scalars.items():
                self.writer.add_scalar(tag, v, record.step)
            for tag, h in record.histograms.items():
                self.writer.add_histogram_raw(
                    tag, h.min, h.max, h.num, h.sum, h.sum_squares, h.bucket_limits, h.bucket_counts, record.step
                )
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
