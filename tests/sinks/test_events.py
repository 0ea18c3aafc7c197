"""Event files written with the C CRC32C: byte-compatible with TensorBoard's own reader."""

import os

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_crc
from torch.utils.tensorboard import SummaryWriter

from layerwatch.sinks.record import StepRecord
from layerwatch.sinks import event_file as events
from layerwatch.sinks.tensorboard import TensorBoardSink

pytestmark = pytest.mark.skipif(not events.AVAILABLE, reason="no C CRC32C package installed")


@pytest.mark.parametrize("payload", [b"", b"a", bytes(range(256)) * 9, os.urandom(5000)])
def test_masked_crc_equals_tensorboards(payload):
    assert events.masked_crc32c(payload) == tensorboard_crc(payload)


def read_events(log_dir):
    (path,) = [os.path.join(log_dir, f) for f in os.listdir(log_dir) if f.startswith("events.out.tfevents")]
    return list(EventFileLoader(path).Load())  # checks both CRCs of every record


def test_records_interleave_with_the_writers_own_in_one_readable_file(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    sink = TensorBoardSink(writer, owns_writer=False)
    for step in range(3):
        writer.add_scalar("train/loss", 1.0 / (step + 1), step)  # queued on the writer's thread
        sink.write(StepRecord(step, scalars={"weights_norm/fc.weight": float(step)}))
    writer.close()
    loaded = read_events(tmp_path)
    tags = [(e.step, v.tag) for e in loaded for v in e.summary.value if not v.tag.startswith("layerwatch/")]
    assert tags == [(s, t) for s in range(3) for t in ("train/loss", "weights_norm/fc.weight")]
    tab = [(e.step, v.tag) for e in loaded for v in e.summary.value if v.tag.startswith("layerwatch/")]
    assert tab == [(0, "layerwatch/layout")] + [(s, "layerwatch/series/weights_norm") for s in range(3)]
    ours = [e for e in loaded if e.summary.value and e.summary.value[0].tag.startswith("weights")]
    assert [e.summary.value[0].tensor.float_val[0] for e in ours] == [0.0, 1.0, 2.0]  # the loader migrates scalars to tensors
    assert all(e.wall_time > 0 for e in ours)


def test_without_a_c_crc_the_writers_own_path_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(events, "AVAILABLE", False)
    writer = SummaryWriter(str(tmp_path))
    TensorBoardSink(writer, owns_writer=True).write(StepRecord(5, scalars={"a/b": 2.0}))
    writer.close()
    (event,) = [e for e in read_events(tmp_path) if e.summary.value]
    assert (event.step, event.summary.value[0].tag, event.summary.value[0].tensor.float_val[0]) == (5, "a/b", 2.0)
