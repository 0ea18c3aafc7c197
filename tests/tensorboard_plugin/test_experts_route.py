"""The tab's experts view's data: the ``experts`` route through a real TensorBoard server, over
router loads written as the engine writes them; and the one-file share holding its answer."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from layerwatch.cli import main
from layerwatch.routing import shares
from layerwatch.sinks.record import StepRecord
from layerwatch.sinks.tensorboard import TensorBoardSink
from layerwatch.tensorboard_plugin.packing import unpack
from moe_runs import load, write_loads
from tb_server import serve

A, B = "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"
LOADS = {
    0: {A: load([6, 2, 0, 0], bias=[0.5, -0.5, 0.0, 0.25]), B: load([4, 4])},
    2: {A: load([5, 3, 0, 0], bias=[0.75, -0.5, 0.0, 0.25]), B: load([1, 7])},
    4: {B: load([2, 6])},  # A not called at this step
}


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path_factory.mktemp("experts")
    write_loads(logdir / "moe", LOADS)
    sink = TensorBoardSink(SummaryWriter(str(logdir / "dense")), owns_writer=True)  # a run without routers
    for step in (0, 2):
        sink.write(StepRecord(step, scalars={"grads_norm/fc.weight": 1.0 + step}))
    sink.close()
    return logdir


@pytest.fixture(scope="module")
def server(logdir):
    def loaded(server):
        runs = server.get_json("/data/plugin/layerwatch/runs")["runs"]
        return len(runs) == 2 and {run["last_step"] for run in runs} == {2, 4}

    with serve(logdir, ready=loaded) as server:
        yield server


def route(server, path, **params):
    return server.get_json(f"/data/plugin/layerwatch/{path}", **params)


def rows(answer: dict, key: str, count: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(answer[key]), dtype="<f4").reshape(count, len(answer["steps"]))


def test_the_experts_route_has_each_routers_tokens_shares_and_imbalance(server):
    answer = route(server, "experts", run="moe")
    assert answer["routers"] == [A, B] and answer["experts"] == [4, 2] and answer["steps"] == [0, 2, 4]
    tokens, expert_shares = rows(answer, "tokens", 6), rows(answer, "shares", 6)
    assert tokens[:4, :2].T.tolist() == [[6, 2, 0, 0], [5, 3, 0, 0]] and np.isneginf(tokens[:4, 2]).all()
    assert tokens[4:].T.tolist() == [[4, 4], [1, 7], [2, 6]]
    for r, block in ((0, slice(0, 4)), (1, slice(4, 6))):
        measured = np.isfinite(tokens[block]).all(axis=0)
        assert np.allclose(expert_shares[block][:, measured], shares(tokens[block][:, measured].T).T)  # routing.shares
    assert np.isneginf(expert_shares[:4, 2]).all()  # not measured stays so
    imbalance = rows(answer, "imbalance", 2)
    heatmap = route(server, "heatmap", run="moe", stat="moe_imbalance")  # the series as written
    assert heatmap["rows"] == [A, B]
    assert np.array_equal(imbalance, rows(heatmap, "values", 2)) and imbalance[0, :2].tolist() == [3.0, 2.5]


def test_the_tab_describes_the_routers_series_and_folds_experts_as_heads(server):
    stats = {stat["key"]: stat for stat in route(server, "stats", run="moe")["stats"]}
    assert {"moe_tokens", "moe_imbalance", "moe_dead", "moe_entropy", "moe_margin", "moe_router_z",
            "moe_router_z_max", "moe_bias"} <= set(stats)
    assert stats["moe_tokens"]["parts"] == "experts" and stats["moe_bias"]["parts"] == "experts"
    assert "parts" not in stats["moe_imbalance"] and stats["moe_imbalance"]["label"] == "expert load imbalance"
    router = route(server, "layer", run="moe", name=A)
    assert list(router["heads"]) == ["moe_tokens", "moe_bias"]  # a router's experts, as a module's heads
    assert router["heads"]["moe_tokens"]["heads"] == [f"{A}#{e}" for e in range(4)]
    assert router["heads"]["moe_bias"]["values"][0] == [0.5, 0.75]
    assert route(server, "layer", run="moe", name=f"{A}#1")["series"]["moe_tokens"] == [2.0, 3.0, None]  # not called at 4


def test_a_run_without_routers_has_no_experts(server):
    status, body = server.status("/data/plugin/layerwatch/experts", run="dense")
    assert (status, json.loads(body)) == (404, {"error": "run 'dense' has no Mixture-of-Experts router (no moe_tokens series)"})


def test_the_shared_file_holds_the_experts_answer(logdir, tmp_path):
    from layerwatch.tensorboard_plugin.share import _ask, _plugin, _provider

    out = tmp_path / "moe.html"
    assert main(["report", str(logdir), "--html", str(out)]) == 0
    data = re.search(r'<script id="layerwatch-data" type="application/octet-stream">([^<]*)</script>', out.read_text())
    held = unpack(base64.b64decode(data.group(1)))
    plugin = _plugin(_provider(logdir, ["dense", "moe"]))
    assert list(held["experts"]) == ["moe"]  # only a run with routers: index.js asks for no other
    assert held["experts"]["moe"] == _ask(plugin.experts, {"run": "moe"})
    assert held["layer"][f"{A}#3"]["moe"][0] == 200  # each expert's row, for a click on its cell
