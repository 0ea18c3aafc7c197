import math

import pytest
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

from layerwatch.record import StepRecord
from layerwatch.sinks.tensorboard import encode_summary
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
