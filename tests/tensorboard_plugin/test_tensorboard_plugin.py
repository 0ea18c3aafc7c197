"""The LAYERWATCH tab's backend, through a real TensorBoard server (Python reader and Rust data
server), over a run with a NaN incident and a run with attention heads; and the cards the
standard tabs get."""

from __future__ import annotations

import argparse
import base64
import json
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from event_logs import read_events
from layerwatch import Inspector
from models import Poison, SdpaLM, lm_step
from tb_server import serve

POISON_STEP = 8  # a sampled step: the probes are armed when the NaN appears
STEPS = [0, 2, 4, 6, 8, 9, 10, 12]  # every 2, and the step after the sentinel saw NaN gradients


def incident_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        embed=nn.Linear(8, 16), act=nn.ReLU(),
        block=nn.Sequential(nn.Linear(16, 16), Poison(step=POISON_STEP)),
        head=nn.Linear(16, 4),
    ))


@pytest.fixture(scope="module")
def incident(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("logs")
    model = incident_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(RuntimeWarning):
        with Inspector(model, log_dir=logdir / "incident", every_n_steps=2, optimizer=opt) as inspector:
            for _ in range(14):
                loss = model(torch.randn(16, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                inspector.step()
    writer = SummaryWriter(str(logdir / "plain"))  # a run without layerwatch data beside it
    writer.add_scalar("loss", 1.0, 0)
    writer.close()
    return logdir


def has_rust_server() -> bool:
    try:
        from tensorboard.data import server_ingester

        return server_ingester.get_server_binary() is not None
    except Exception:
        return False


def decode(heatmap: dict) -> np.ndarray:
    values = np.frombuffer(base64.b64decode(heatmap["values"]), dtype="<f4")
    return values.reshape(len(heatmap["rows"]), len(heatmap["steps"]))


@pytest.fixture(scope="module", params=[False, pytest.param(True, marks=pytest.mark.skipif(
    not has_rust_server(), reason="no Rust data server for this platform"))], ids=["python-reader", "load-fast"])
def server(request, incident):
    def loaded(server):
        runs = server.get_json("/data/plugin/layerwatch/runs")["runs"]
        return runs and runs[0]["last_step"] == 12

    with serve(incident, load_fast=request.param, ready=loaded) as server:
        yield server


def route(server, path, **params):
    return server.get_json(f"/data/plugin/layerwatch/{path}", **params)


def test_the_tab_is_listed_and_serves_its_own_front_end(server):
    listing = server.get_json("/data/plugins_listing")["layerwatch"]
    assert listing["enabled"] and listing["loading_mechanism"] == {"type": "IFRAME", "module_path": "/data/plugin/layerwatch/index.js"}
    script = server.get("/data/plugin/layerwatch/index.js").decode()
    assert "export async function render" in script
    assert "https://" not in script and "http://" not in script  # nothing from a CDN


def test_runs_lists_only_runs_with_layerwatch_data(server):
    assert route(server, "runs") == {"runs": [{"run": "incident", "first_step": 0, "last_step": 12, "samples": 8}]}
    assert "loss" in server.get_json("/data/plugin/scalars/tags")["plain"]  # the other tabs are untouched


def test_the_heatmap_holds_every_sampled_value_and_marks_the_nan(server, incident):
    stats = route(server, "stats", run="incident")
    keys = [s["key"] for s in stats["stats"]]
    assert keys[:3] == ["grads_norm", "weights_norm", "update_ratio"]
    assert {"fwd_ms", "bwd_ms", "activation_bytes", "saved_bytes", "nonfinite", "activations_norm"} <= set(keys)
    heatmap = route(server, "heatmap", run="incident", stat="grads_norm")
    names = [n for n, _ in incident_model().named_parameters()]
    assert heatmap["rows"] == names  # model order
    assert heatmap["steps"] == STEPS
    values = decode(heatmap)
    cards = read_events(incident / "incident")
    for i, name in enumerate(names):
        card = {e.step: e.value for e in cards.Scalars(f"grads_norm/{name}")}
        for j, step in enumerate(heatmap["steps"][:4]):
            assert values[i, j] == pytest.approx(card[step], rel=1e-6)
    at = heatmap["steps"].index(POISON_STEP)
    assert np.isfinite(values[:, :at]).all() and np.isnan(values[:, at]).all()  # NaN: a finding, not "no value"

    fwd = route(server, "heatmap", run="incident", stat="fwd_ms")
    fwd_values = decode(fwd)
    assert fwd["rows"][0] == "(root)" and "block.1" in fwd["rows"]
    assert fwd["steps"] == STEPS[1:]  # the layer table's step is not timed
    assert (fwd_values > 0).all()


def tab_reader(records, wall_times=None):
    """A Reader over the tab's values of ``records`` as one PluginData wrote them, and the
    number of layouts written."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    from layerwatch.sinks.plugin_data import PluginData
    from layerwatch.reading.events import LAYOUT, Reader

    plugin, reader, layouts = PluginData(), Reader(), 0
    for i, record in enumerate(records):
        wall = float(i) if wall_times is None else wall_times[i]
        for value in Summary.FromString(plugin.encode(record)).value:
            reader.add_tensor(record.step, wall, value.tag, value.tensor)
            layouts += value.tag == LAYOUT
    return reader, layouts


def test_a_layer_that_comes_and_goes_reads_minus_inf_and_writes_the_layout_once_more():
    from layerwatch.sinks.record import StepRecord

    steps = [{"fwd_ms/l.0": 1.0, "fwd_ms/m": 2.0}, {"fwd_ms/l.0": 3.0, "fwd_ms/l.1": 5.0, "fwd_ms/m": 6.0},
             {"fwd_ms/l.0": 4.0, "fwd_ms/m": float("nan")}, {"fwd_ms/l.0": 7.0, "fwd_ms/l.1": 8.0, "fwd_ms/m": 9.0}]
    reader, layouts = tab_reader([StepRecord(k, scalars=s) for k, s in enumerate(steps)])
    assert layouts == 2  # the first step, and when l.1 first came; not each time it comes or goes
    rows, at, matrix = reader.matrix("fwd_ms")
    assert rows == ["l.0", "l.1", "m"] and at == [0, 1, 2, 3]  # l.1 beside its sibling, not appended
    assert matrix[0].tolist() == [1.0, 3.0, 4.0, 7.0]
    assert np.isneginf(matrix[1, [0, 2]]).all() and matrix[1, [1, 3]].tolist() == [5.0, 8.0]
    assert matrix[2, 0] == 2.0 and np.isnan(matrix[2, 2])


def test_a_run_resumed_into_the_same_directory_reads_each_step_with_its_own_layout():
    from layerwatch.sinks.record import StepRecord
    from layerwatch.sinks.plugin_data import PluginData
    from layerwatch.reading.events import Reader
    from tensorboard.compat.proto.summary_pb2 import Summary

    first = [StepRecord(0, scalars={"g/a": 1.0, "g/b": 2.0}), StepRecord(30, scalars={"g/a": 3.0, "g/c": 4.0, "g/b": 5.0})]
    resumed = [StepRecord(20, scalars={"g/a": 10.0, "g/b": 20.0}), StepRecord(30, scalars={"g/a": 30.0, "g/b": 230.0})]
    reader = Reader()
    for wall, (plugin, records) in enumerate([(PluginData(), first), (PluginData(), resumed)]):
        for k, record in enumerate(records):
            for value in Summary.FromString(plugin.encode(record)).value:
                reader.add_tensor(record.step, 10.0 * wall + k, value.tag, value.tensor)
    series = reader.series("g")
    assert series[30][0] == ["a", "b"] and series[30][1].tolist() == [30.0, 230.0]  # the resumed write, its layout
    assert series[0][1].tolist() == [1.0, 2.0] and series[20][1].tolist() == [10.0, 20.0]


def test_the_run_wide_nonfinite_count_adds_every_piece():
    from layerwatch.sinks.record import build
    from layerwatch.vocabulary import nonfinite_total_tag
    from layerwatch import stats as S

    pieces = []
    for name, count in (("a", 0.0), ("b", 3.0)):  # two optimizers' reads of one step
        row = np.zeros((1, S.HIST + 2))
        row[0, S.COUNT], row[0, S.NONFINITE] = 4.0, count
        pieces.append(([name], row))
    record = build(0, {"grads": pieces}, stats=("nonfinite",))
    assert record.scalars[nonfinite_total_tag("grads")] == 3.0


def test_a_growth_beyond_float32_is_a_finite_factor():
    from layerwatch.sinks.record import StepRecord
    from layerwatch.reading import rankings

    reader, _ = tab_reader([StepRecord(0, scalars={"grads_norm/a": 1e-20}), StepRecord(1, scalars={"grads_norm/a": 1e20})])
    assert rankings.growth(reader.table("grads_norm"))[0]["factor"] == pytest.approx(1e40, rel=1e-6)


def test_events_name_the_first_nonfinite_step_and_the_offender(server):
    events = route(server, "events", run="incident")
    assert events["first_nonfinite_step"] == POISON_STEP
    assert events["first_offender"]["layer"] == "block.1"
    assert events["first_offender"]["step"] == POISON_STEP and events["first_offender"]["phase"] == "forward"
    assert any(a["kind"] == "nonfinite" and a["step"] == POISON_STEP for a in events["alerts"])


def test_rankings_answer_what_the_report_answers(server):
    rankings = {r["key"]: r for r in route(server, "rankings", run="incident")["rankings"]}
    assert set(rankings) == {"slowest", "memory", "grad_growth"}
    slowest = [row["layer"] for row in rankings["slowest"]["rows"]]
    assert slowest and set(slowest) <= {"embed", "act", "block.0", "block.1", "head"}  # leaves only
    memory = {row["layer"]: row["value"] for row in rankings["memory"]["rows"]}
    assert memory["embed"] == 16 * 16 * 4 + 16 * 8 * 4  # its output, and its input saved for backward
    assert rankings["grad_growth"]["rows"]  # gradient norms over the finite samples


def test_a_layer_has_its_series_and_histograms(server):
    layer = route(server, "layer", run="incident", name="block.0.weight")
    assert layer["steps"] == STEPS
    assert set(layer["series"]) >= {"grads_norm", "weights_norm", "update_ratio"}
    assert layer["series"]["grads_norm"][4] == "NaN" and isinstance(layer["series"]["grads_norm"][3], float)
    histograms = layer["histograms"]
    assert set(histograms) == {"weights/block.0.weight", "grads/block.0.weight"}
    first = histograms["weights/block.0.weight"][0]
    assert first["step"] == 0 and sum(count for _, _, count in first["buckets"]) == pytest.approx(16 * 16)
    module = route(server, "layer", run="incident", name="block.0")
    assert "fwd_ms" in module["series"] and "activations/block.0" in module["histograms"]
    assert "weights/block.0.weight" in module["histograms"]  # a module shows its own parameters' histograms


def test_bad_requests_get_a_message(server):
    status, body = server.status("/data/plugin/layerwatch/heatmap", run="incident", stat="no_such_stat")
    assert (status, json.loads(body)) == (404, {"error": "run 'incident' has no series 'no_such_stat'"})
    status, body = server.status("/data/plugin/layerwatch/stats", run="plain")
    assert (status, json.loads(body)) == (404, {"error": "no layerwatch data in run 'plain'"})
    status, body = server.status("/data/plugin/layerwatch/heatmap", run="incident")
    assert (status, json.loads(body)) == (400, {"error": "missing query parameter 'stat'"})


def test_a_logdir_without_layerwatch_data_lists_no_run(tmp_path):
    writer = SummaryWriter(str(tmp_path / "plain"))
    writer.add_scalar("loss", 1.0, 0)
    writer.close()
    with serve(tmp_path, ready=lambda s: "plain" in s.get_json("/data/plugin/scalars/tags")) as server:
        assert route(server, "runs") == {"runs": []}
        assert "layerwatch" in server.get_json("/data/plugins_listing")  # listed; the page says why it is empty


def test_the_loader_keeps_every_sample_of_the_tab_unless_told_otherwise():
    from layerwatch.tensorboard_plugin import LayerwatchLoader

    flags = argparse.Namespace(samples_per_plugin={})
    LayerwatchLoader().fix_flags(flags)
    assert flags.samples_per_plugin == {"layerwatch": 0}  # 0: all, for both readers
    flags = argparse.Namespace(samples_per_plugin={"layerwatch": 50, "images": 3})
    LayerwatchLoader().fix_flags(flags)
    assert flags.samples_per_plugin == {"layerwatch": 50, "images": 3}


def test_tensorboard_finds_the_tab_and_does_not_import_torch_for_it():
    import subprocess
    import sys

    code = ("import sys; from tensorboard import default; "
            "assert any(p.__name__ == 'LayerwatchLoader' for p in default.get_dynamic_plugins()); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_12_layer_transformer_keeps_under_1200_cards_at_the_defaults(tmp_path):
    import lightning.pytorch as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from layerwatch import InspectCallback
    from models import LitTransformer

    logger = TensorBoardLogger(tmp_path, name="tfm", version=0)
    L.Trainer(accelerator="cpu", max_steps=3, logger=logger, callbacks=[InspectCallback(every_n_steps=2)],
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(LitTransformer())
    acc = read_events(logger.log_dir)
    tags = acc.Tags()
    assert len(tags["scalars"]) + len(tags["histograms"]) <= 1200
    families = {t.split("/")[0] for t in tags["scalars"]}
    assert {"weights_norm", "grads_norm", "update_ratio", "fwd_ms", "bwd_ms", "activations_norm"} <= families
    assert not families & {"activation_bytes", "saved_bytes", "nonfinite", "grads_nonfinite", "weights_nonfinite"}
    assert {t.split("/")[0] for t in tags["histograms"]} == {"weights", "grads", "activations"}


def test_the_tab_forgets_the_points_of_a_run_deleted_from_the_log_directory():
    from types import SimpleNamespace

    from layerwatch.reading.events import SERIES
    from layerwatch.tensorboard_plugin.plugin import LayerwatchPlugin

    tag, meta = SERIES + "norm", SimpleNamespace(max_step=4, max_wall_time=1.0)
    listing = {"a": {tag: meta}, "b": {tag: meta}}

    class Provider:
        reads = 0

        def list_tensors(self, ctx, experiment_id, plugin_name):
            return listing

        def read_tensors(self, ctx, experiment_id, plugin_name, downsample, run_tag_filter):
            Provider.reads += 1
            (run,) = run_tag_filter.runs
            return {run: {tag: [SimpleNamespace(step=4, wall_time=1.0, numpy=np.ones(3, np.float32))]}}

    plugin = LayerwatchPlugin(SimpleNamespace(data_provider=Provider()))
    for run in ("a", "b", "a"):
        assert len(plugin._read(None, "exp", run, tag, meta)[0][2]) == 3
    assert Provider.reads == 2  # the second read of run a came from the cache
    del listing["b"]
    plugin._tags(None, "exp")
    assert list(plugin._cache) == [("exp", "a", tag)]


@pytest.fixture(scope="module")
def attention_server(tmp_path_factory):
    """A run of a two-block SDPA model (2 heads each), every step sampled: attention from the first sample on."""
    logdir = tmp_path_factory.mktemp("attention")
    torch.manual_seed(0)
    model = SdpaLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # too few samples for the trend rules
        with Inspector(model, log_dir=logdir / "sdpa", every_n_steps=1, optimizer=opt) as inspector:
            for _ in range(4):
                ids = torch.randint(0, 32, (4, 12))
                lm_step(model, opt, ids)
                inspector.step()
        torch._dynamo.reset()
        compiled = torch.compile(SdpaLM(), backend="aot_eager")  # measured on its re-runs
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
        with Inspector(compiled, log_dir=logdir / "compiled", every_n_steps=1, optimizer=opt) as inspector:
            for _ in range(4):
                lm_step(compiled, opt, torch.randint(0, 32, (4, 12)))
                inspector.step()

    def loaded(server):
        runs = server.get_json("/data/plugin/layerwatch/runs")["runs"]
        return len(runs) == 2 and all(run["last_step"] == 3 for run in runs)

    with serve(logdir, ready=loaded) as server:
        yield server


def test_an_attention_module_has_its_heads_as_heads_x_steps(attention_server):
    module = route(attention_server, "layer", run="sdpa", name="blocks.0.attn")
    heads = module["heads"]
    assert list(heads) == ["attention_head_logit_max", "attention_head_entropy"]  # the tab's order of series
    for key, folded, combine in (("attention_head_logit_max", "attention_logit_max", max),
                                 ("attention_head_entropy", "attention_entropy", min)):
        of = heads[key]
        assert of["heads"] == ["blocks.0.attn#0", "blocks.0.attn#1"]
        assert of["steps"] == [0, 1, 2, 3]  # from the first sample on
        assert len(of["values"]) == 2 and all(len(row) == 4 for row in of["values"])
        heatmap = route(attention_server, "heatmap", run="sdpa", stat=key)
        values = decode(heatmap)
        for h, name in enumerate(of["heads"]):
            row = values[heatmap["rows"].index(name), [heatmap["steps"].index(step) for step in of["steps"]]]
            assert of["values"][h] == pytest.approx(row.tolist(), rel=1e-6)
        # the module's own series is its heads folded: the largest logit, the lowest entropy
        own = dict(zip(module["steps"], module["series"][folded]))
        for i, step in enumerate(of["steps"]):
            assert own[step] == pytest.approx(combine(row[i] for row in of["values"]), rel=1e-6)


def test_a_compiled_models_forward_time_is_said_to_be_its_eager_re_runs(attention_server):
    """A compiled model's per-module values come from an eager re-run of the sampled step's batch
    (its events say so): the tab names its ``fwd_ms`` for what it is."""
    labels = {run: {s["key"]: s for s in route(attention_server, "stats", run=run)["stats"]} for run in ("sdpa", "compiled")}
    assert labels["sdpa"]["fwd_ms"]["label"] == "forward time"
    assert labels["compiled"]["fwd_ms"]["label"] == "forward time (eager re-run)"
    assert "autograd off" in labels["compiled"]["fwd_ms"]["unit"]
    assert "bwd_ms" in labels["sdpa"] and "bwd_ms" not in labels["compiled"]
    notes = {run: {r["key"]: r["note"] for r in route(attention_server, "rankings", run=run)["rankings"]}
             for run in ("sdpa", "compiled")}
    assert notes["sdpa"]["slowest"] == "leaf layers, median forward + backward ms over the samples"
    assert "eager re-run" in notes["compiled"]["slowest"] and "nothing saved" in notes["compiled"]["memory"]


def test_a_head_has_its_own_series_and_a_layer_without_heads_has_none(attention_server):
    module = route(attention_server, "layer", run="sdpa", name="blocks.1.attn")
    head = route(attention_server, "layer", run="sdpa", name="blocks.1.attn#1")
    assert set(head["series"]) == {"attention_head_logit_max", "attention_head_entropy"}
    assert head["steps"] == [0, 1, 2, 3] and head["heads"] == {} and head["histograms"] == {}
    for key, series in head["series"].items():
        assert series == module["heads"][key]["values"][1]
    for name in ("blocks.1", "blocks.1.attn.q", "blocks.1.attn.q.weight"):
        assert route(attention_server, "layer", run="sdpa", name=name)["heads"] == {}
    status, body = attention_server.status("/data/plugin/layerwatch/layer", run="sdpa", name="blocks.1.attn#7")
    assert (status, json.loads(body)) == (404, {"error": "run 'sdpa' has no layer 'blocks.1.attn#7'"})
