"""rankings.py: the one answer to "which layers stand out" for the report and the tab."""

import math

import numpy as np

from layerwatch.reading.rankings import Table, growth, norms, top_by_median


def table(points):
    return Table.from_points(points)


def test_from_points_aligns_steps_and_leaves_nan_where_a_layer_has_no_value():
    t = table({"a": [(0, 1.0), (10, 2.0)], "b": [(10, 5.0)]})
    assert t.names == ["a", "b"] and t.steps.tolist() == [0, 10]
    assert t.values[0].tolist() == [1.0, 2.0] and math.isnan(t.values[1, 0]) and t.values[1, 1] == 5.0


def test_top_by_median_ranks_leaves_by_the_sum_of_their_medians():
    fwd = table({"(root)": [(0, 9.0)], "enc": [(0, 6.0)], "enc.0": [(0, 1.0), (1, 3.0), (2, 2.0)], "enc.1": [(0, 4.0)],
                 "head": [(0, float("nan")), (1, 0.5)]})
    bwd = table({"enc.0": [(0, 3.0)], "head": [(0, 0.25)]})
    ranked = top_by_median([fwd, bwd], unit="ms")
    assert ranked == [{"name": "enc.0", "ms": 5.0}, {"name": "enc.1", "ms": 4.0}, {"name": "head", "ms": 0.75}]


def test_norms_and_growth_read_the_first_and_last_finite_values():
    t = table({"up": [(0, 1.0), (5, 8.0)], "down": [(0, 100.0), (5, 1.0)], "flat": [(0, 2.0), (5, 2.0)],
               "nan_end": [(0, 1.0), (5, float("nan"))]})
    result = norms(t)
    assert [r["name"] for r in result["largest"]] == ["up", "flat", "down", "nan_end"]  # last finite value
    assert [r["name"] for r in result["fastest_changing"]] == ["down", "up", "flat"]  # |log factor|, either way
    assert [r["name"] for r in growth(t)] == ["up", "flat", "down"]  # grew most first
    assert growth(t)[0] == {"name": "up", "from_step": 0, "to_step": 5, "first": 1.0, "last": 8.0, "factor": 8.0}
    assert norms(t, until=5)["fastest_changing"] == []  # one sample before step 5: no change to rank


def test_an_empty_table_ranks_nothing():
    empty = Table([], np.zeros(0, dtype=np.int64), np.zeros((0, 0)))
    assert norms(empty) == {"largest": [], "fastest_changing": []}
    assert growth(empty) == [] and top_by_median([empty], unit="ms") == []
