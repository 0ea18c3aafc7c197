"""The sampled step's reads (layerwatch.measure.reads): each parameter read once, at the first point
of the step where it is final, and its rows on the host in one transfer."""

import numpy as np
import pytest
import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.distributed.sharding import FAILED_NORM
from layerwatch.guards.failures import FailurePolicy
from layerwatch.options import validate_options
from layerwatch.measure.params import ParameterFamilies, parameters
from layerwatch.measure.reads import Sample, SampleReads


def two_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    return model, first, second


def reads_of(**options) -> SampleReads:
    validated = validate_options(**options)
    failures = FailurePolicy()
    return SampleReads(validated, failures, ParameterFamilies(validated, failures))


def names(pieces) -> list[str]:
    return [name for piece_names, _ in pieces for name in piece_names]


def test_each_optimizer_s_gradients_are_read_before_its_own_step_and_its_weights_after():
    model, first, second = two_optimizers()
    reads = reads_of()
    sample = Sample(3, parameters(model), steps_before=None)
    reads.before_optimizer_step(sample, first, zero=None)
    assert names(sample.grads) == ["0.weight", "0.bias"]
    first.step()
    reads.after_optimizer_step(sample, first)
    assert names(sample.weights) == ["0.weight", "0.bias"] and names(sample.update) == ["0.weight", "0.bias"]
    reads.before_optimizer_step(sample, second, zero=None)
    second.step()
    reads.after_optimizer_step(sample, second)
    assert names(sample.grads) == names(sample.weights) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert (sample.before_calls, sample.after_calls) == (2, 2)
    assert sample.snapshots == []  # each optimizer's snapshot was measured after its own step


def test_the_end_of_the_step_reads_only_what_the_optimizer_points_left_unread():
    model, first, _ = two_optimizers()
    reads = reads_of()
    sample = Sample(0, parameters(model), steps_before=None)
    reads.before_optimizer_step(sample, first, zero=None)
    reads.rest(sample)
    assert names(sample.grads) == ["0.weight", "0.bias", "1.weight", "1.bias"]  # each once
    assert names(sample.weights) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert names(sample.update) == ["0.weight", "0.bias"]  # only the snapshot taken before a step
    reads.rest(sample)
    assert len(names(sample.grads)) == 4 and len(names(sample.weights)) == 4


def test_the_families_left_out_are_not_read():
    model, first, _ = two_optimizers()
    reads = reads_of(families=("weights",))
    sample = Sample(0, parameters(model), steps_before=None)
    reads.before_optimizer_step(sample, first, zero=None)
    reads.rest(sample)
    assert sample.grads == [] and sample.update == [] and sample.snapshots == []
    assert names(sample.weights) == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_the_host_rows_are_the_families_rows_by_name():
    model, first, _ = two_optimizers()
    reads = reads_of()
    sample = Sample(0, parameters(model), steps_before=None)
    reads.before_optimizer_step(sample, None, zero=None)
    first.step()
    reads.after_optimizer_step(sample, None)
    rows = reads.host_rows(sample)
    (grad_names, grad_rows), = rows["grads"]
    assert grad_names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    expected = [p.grad.norm().item() for _, p in parameters(model)]
    np.testing.assert_allclose(S.Rows(grad_rows).norm, expected, rtol=1e-5)
    (update_names, update_rows), = rows["update"]
    assert update_names == grad_names and update_rows.shape[0] == 2  # [|dw|, |w|] rows
    assert update_rows[0][2] == 0.0  # the second layer's optimizer did not step
    assert rows["update_estimate"] == []


def test_rows_a_rank_could_not_measure_are_left_out_and_said_once(recwarn):
    reads = reads_of()
    rows = np.ones((2, S.HIST + 4))
    rows[1, S.COUNT] = np.nan  # what combine_shards leaves of a tensor a rank could not help measure
    kept, kept_rows = reads._measured("grads", ["a", "b"], rows, step=4)
    assert kept == ["a"] and kept_rows.shape == (1, S.HIST + 4)
    updates = np.array([[0.5, FAILED_NORM], [2.0, 3.0]])  # [|dw|, |w|] columns of two tensors
    kept, kept_rows = reads._measured("update", ["a", "b"], updates, step=4)
    assert kept == ["a"] and kept_rows.tolist() == [[0.5], [2.0]]
    reads._measured("grads", ["a", "b"], rows, step=5)
    said = [str(w.message) for w in recwarn if "layerwatch: a rank could not" in str(w.message)]
    assert said == ["layerwatch: a rank could not measure its shards of b (grads); they are left out of step 4",
                    "layerwatch: a rank could not snapshot its shards of b for the update ratios; their update ratios "
                    "are left out of step 4"]


@pytest.mark.parametrize("before, after, counted, stepped", [
    (0, 0, None, None),  # neither optimizer point came: unknown
    (1, 1, None, True),
    (1, 0, None, False),  # a skipped step runs no post-hook
    (1, 0, 8, True),  # counted: the count decides
    (1, 1, 7, False),
])
def test_whether_the_optimizer_stepped_is_counted_or_else_told_by_the_points_that_came(before, after, counted, stepped):
    sample = Sample(0, [], steps_before=None if counted is None else 7, before_calls=before, after_calls=after)
    assert sample.stepped(counted) is stepped


def test_the_trainable_parameters_leave_out_frozen_ones_and_sparse_gradients():
    embedding = nn.Embedding(5, 2, sparse=True)
    model = nn.ModuleDict({"emb": embedding, "frozen": nn.Linear(2, 2), "head": nn.Linear(2, 1)})
    model["frozen"].requires_grad_(False)
    model["head"](model["frozen"](embedding(torch.tensor([1, 2])))).sum().backward()
    sample = Sample(0, parameters(model), steps_before=None)
    assert sample.trainable() == ["head.weight", "head.bias"]
