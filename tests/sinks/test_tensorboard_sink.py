import math

import pytest
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

from layerwatch.sinks.record import StepRecord
from layerwatch.sinks.tensorboard import TensorBoardSink, encode_summary
from layerwatch.stats import Histogram


def test_encoded_summary_equals_the_proto_built_field_by_field():
    long_tag = "weights/" + "encoder.layers.0." * 12 + "weight"  # > 127 bytes: multi-byte varint length
    hist = Histogram(-1.5, 2.25, 300.0, 12.5, 99.0, [-1.0, 0.5, 2.25], [10.0, 200.0, 90.0])
    record = StepRecord(7, scalars={"weights_norm/fc.weight": 3.5, "layerwatch/grad_norm": math.inf},
                        histograms={long_tag: hist, "grads/fc.bias": Histogram(0.0, 0.0, 4, 0, 0, [0.0], [4.0])})
    expected = Summary(value=[
        Summary.Value(tag="weights_norm/fc.weight", simple_value=3.5),
        Summary.Value(tag="layerwatch/grad_norm", simple_value=math.inf),
        Summary.Value(tag=long_tag, histo=HistogramProto(min=-1.5, max=2.25, num=300, sum=12.5, sum_squares=99,
                                                         bucket_limit=[-1.0, 0.5, 2.25], bucket=[10, 200, 90])),
        Summary.Value(tag="grads/fc.bias", histo=HistogramProto(min=0, max=0, num=4, sum=0, sum_squares=0,
                                                                bucket_limit=[0.0], bucket=[4.0])),
    ])
    assert Summary.FromString(encode_summary(record)) == expected


def test_empty_record_encodes_to_an_empty_summary():
    assert Summary.FromString(encode_summary(StepRecord(0))) == Summary()


@pytest.mark.parametrize("value", [0.0, -2.5, 1e-30, math.nan])
def test_scalar_values_round_trip_as_float32(value):
    parsed = Summary.FromString(encode_summary(StepRecord(0, scalars={"a/b": value}))).value[0]
    assert parsed.tag == "a/b"
    assert (math.isnan(parsed.simple_value) and math.isnan(value)) or parsed.simple_value == pytest.approx(value)


def test_texts_encode_as_tensorboard_text_summaries():
    record = StepRecord(3, scalars={"a/b": 1.0}, texts={"layerwatch/structure": "    table | x"})
    values = Summary.FromString(encode_summary(record)).value
    assert [v.tag for v in values] == ["a/b", "layerwatch/structure/text_summary"]
    assert values[1].metadata.plugin_data.plugin_name == "text"
    assert values[1].tensor.string_val == [b"    table | x"]


class RecordingWriter:
    """A writer with the SummaryWriter methods but not its class (as tensorboardX's)."""

    def __init__(self, with_text: bool) -> None:
        self.calls = []
        if with_text:
            self.add_text = lambda tag, text, step: self.calls.append(("text", tag, step))

    def add_scalar(self, tag, value, step):
        self.calls.append(("scalar", tag, step))

    def add_histogram_raw(self, tag, *args):
        self.calls.append(("histogram", tag, args[-1]))

    def flush(self):
        self.calls.append(("flush",))


@pytest.mark.parametrize("with_text", [True, False])
def test_other_writers_get_values_one_by_one(with_text):
    writer = RecordingWriter(with_text)
    hist = Histogram(0.0, 1.0, 2, 1, 1, [1.0], [2.0])
    record = StepRecord(5, scalars={"a/b": 1.0}, histograms={"weights/w": hist}, texts={"layerwatch/structure": "t"})
    TensorBoardSink(writer, owns_writer=False).write(record)
    expected = [("scalar", "a/b", 5), ("histogram", "weights/w", 5)]
    expected += [("text", "layerwatch/structure", 5)] if with_text else []
    assert writer.calls == expected + [("flush",)]
