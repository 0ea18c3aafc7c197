"""layerwatch.load_experts: a Mixture-of-Experts run's routers in a notebook, one row per expert;
and the routing quantities it reads (layerwatch.routing), one home for the probes and the readers."""

import subprocess
import sys

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

import layerwatch  # noqa: E402
from layerwatch.probes.result import RouterLoad  # noqa: E402
from layerwatch.reading.notebook import EXPERT_COLUMNS  # noqa: E402
from layerwatch.routing import dead_experts, imbalance, shares  # noqa: E402
from moe_runs import COLLAPSED, EXPERTS, TOP_K, load, train_mixtral, write_loads  # noqa: E402

A, B = "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"


def test_the_routing_quantities():
    tokens = np.array([6, 2, 0, 0])
    assert imbalance(tokens) == 3.0 and np.isnan(imbalance(np.zeros(4)))
    assert shares(tokens).tolist() == [0.75, 0.25, 0.0, 0.0]
    assert np.isnan(shares(np.zeros(3))).all()
    by_step = shares(np.array([[1, 3], [0, 0], [2, 2]]))  # along the last axis: a router's experts at each step
    assert by_step[0].tolist() == [0.25, 0.75] and np.isnan(by_step[1]).all() and by_step[2].tolist() == [0.5, 0.5]
    assert dead_experts(tokens).tolist() == [False, False, True, True]
    routed = RouterLoad(tokens)  # the probes' record reads the same functions
    assert routed.imbalance == 3.0 and routed.dead == 2


def test_the_routing_quantities_need_no_torch():
    code = "import sys, layerwatch.routing, layerwatch.reading.experts; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_load_experts_has_a_row_per_expert_with_its_tokens_share_and_bias(tmp_path):
    write_loads(tmp_path / "run", {
        0: {A: load([6, 2, 0, 0], bias=[0.5, -0.5, 0.0, 0.25]), B: load([4, 4])},
        2: {A: load([0, 0, 0, 0], bias=[0.5, -0.5, 0.0, 0.25]), B: load([1, 7])},
        4: {B: load([2, 6])},  # A not called at this step
    })
    frame = layerwatch.load_experts(tmp_path)
    assert list(frame.columns) == EXPERT_COLUMNS
    assert frame.dtypes["step"] == np.int64 and frame.dtypes["expert"] == np.int64
    at0 = frame[frame.step == 0]
    assert at0[["layer", "expert"]].values.tolist() == [[A, e] for e in range(4)] + [[B, 0], [B, 1]]  # model order
    assert at0.tokens.tolist() == [6, 2, 0, 0, 4, 4]
    assert at0.share.tolist() == [0.75, 0.25, 0, 0, 0.5, 0.5]
    assert at0.bias.tolist()[:4] == [0.5, -0.5, 0.0, 0.25] and at0.bias.iloc[4:].isna().all()  # B has no bias
    assert frame[(frame.step == 2) & (frame.layer == A)].share.isna().all()  # no token routed: no share
    assert frame[frame.step == 4].layer.unique().tolist() == [B]  # a router not called has no row
    assert frame.groupby(["step", "layer"]).share.sum(min_count=1).dropna().tolist() == [1.0, 1.0, 1.0, 1.0]
    assert set(frame.run) == {"run"}


def test_load_experts_of_a_trained_mixtral_whose_router_collapses(tmp_path):
    train_mixtral(tmp_path / "healthy")
    train_mixtral(tmp_path / "collapse", collapse_from=10)
    frame = layerwatch.load_experts(tmp_path)
    assert set(frame.run) == {"healthy", "collapse"}
    per_router = frame.groupby(["run", "step", "layer"])
    assert (per_router.expert.count() == EXPERTS).all()
    assert (per_router.tokens.sum() == 4 * 16 * TOP_K).all()  # each token counted once per expert it went to
    assert np.allclose(per_router.share.sum(), 1.0)
    collapsed = frame[(frame.run == "collapse") & (frame.layer == COLLAPSED) & (frame.expert == 0)]
    assert (collapsed[collapsed.step >= 10].share == 0.5).all()  # every token's first choice: half the picks
    assert (collapsed[collapsed.step < 10].share < 0.5).all()
    chosen = layerwatch.load_experts(tmp_path, runs="healthy")
    assert set(chosen.run) == {"healthy"} and len(chosen) == len(frame) // 2


def test_a_run_without_routers_is_named(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from layerwatch.sinks.record import StepRecord
    from layerwatch.sinks.tensorboard import TensorBoardSink

    sink = TensorBoardSink(SummaryWriter(str(tmp_path / "dense")), owns_writer=True)
    sink.write(StepRecord(0, scalars={"grads_norm/fc.weight": 1.0}))
    sink.close()
    with pytest.raises(ValueError, match=r"no Mixture-of-Experts router in the runs of .* \(dense\): no moe_tokens"):
        layerwatch.load_experts(tmp_path)


def test_load_experts_is_public_and_lazy():
    assert "load_experts" in layerwatch.__all__ and "load_experts" in dir(layerwatch)
    assert layerwatch.load_experts.__doc__.count(">>>") >= 3
