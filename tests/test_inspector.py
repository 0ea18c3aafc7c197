import gc
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.tensorboard import SummaryWriter

from layerwatch import Inspector, at_steps
from models import FrozenBackbone, MLP, NoParams, HiddenMiddle, TiedLM, hook_count, layerwatch_messages, tab_values, train


class RecordTorchCalls(TorchFunctionMode):
    """Records every torch function called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_weights_and_grads_written_and_match_numpy(tmp_path, events):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    with Inspector(model, log_dir=tmp_path, every_n_steps=2, stats=("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")) as ins:
        for step in range(5):
            loss = model(torch.randn(32, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 2:
                seen = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
            ins.step()
    acc = events(tmp_path)
    names = [n for n, _ in model.named_parameters()]
    parameter_histograms = [t for t in acc.Tags()["histograms"] if not t.startswith("activations/")]
    assert sorted(parameter_histograms) == sorted([f"weights/{n}" for n in names] + [f"grads/{n}" for n in names])
    for name in names:
        assert [e.step for e in acc.Scalars(f"weights_norm/{name}")] == [0, 2, 4]
        for family, tensor in (("weights", seen[name][0]), ("grads", seen[name][1])):
            a = tensor.numpy().ravel()
            expected = {"mean": a.mean(), "std": a.std(), "min": a.min(), "max": a.max(), "norm": np.linalg.norm(a),
                        "zero_frac": (a == 0).mean(), "nonfinite": 0.0}
            assert f"{family}_nonfinite/{name}" not in acc.Tags()["scalars"]  # no card while it stays finite
            assert tab_values(acc)[f"{family}_nonfinite/{name}"] == {0: 0.0, 2: 0.0, 4: 0.0}  # the tab has them
            for stat, value in expected.items():
                if stat == "nonfinite":
                    continue
                got = acc.Scalars(f"{family}_{stat}/{name}")[1]
                assert got.step == 2
                assert got.value == pytest.approx(value, rel=1e-4, abs=1e-6), (family, stat, name)
            hist = acc.Histograms(f"{family}/{name}")[1].histogram_value
            assert hist.num == a.size and sum(hist.bucket) == a.size
            assert hist.min == pytest.approx(a.min()) and hist.max == pytest.approx(a.max())
            counts, _ = np.histogram(a, [hist.min] + list(hist.bucket_limit))
            assert np.abs(counts - np.array(hist.bucket)).sum() <= 2  # at most a value on an edge moves
    grad_norms = acc.Scalars("layerwatch/grad_norm")
    assert grad_norms[1].value == pytest.approx(math.sqrt(sum(g.pow(2).sum().item() for _, g in seen.values())), rel=1e-5)
    assert [e.step for e in acc.Scalars("layerwatch/overhead_ms")] == [0, 2, 4]


def test_defaults_write_norms_nonfinite_and_both_histogram_families(tmp_path, events):
    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1) as ins:
        train(model, 2, ins)  # step 0 records the layer table, so its module times are left out
    tags = events(tmp_path).Tags()
    families = {t.split("/")[0] for t in tags["scalars"] + tags["histograms"]}
    assert families == {
        "weights", "grads", "weights_norm", "grads_norm", "layerwatch",
        "activations", "activations_norm",  # per module, like the parameter families
        "fwd_ms", "bwd_ms",
    }
    # Not cards in a healthy run: the NaN/Inf counts (run-wide ones are) and the bytes; the tab has them.
    assert {"layerwatch/weights_nonfinite", "layerwatch/grads_nonfinite", "layerwatch/activations_nonfinite",
            "layerwatch/nonfinite_modules"} <= set(tags["scalars"])
    tab_families = {t.split("/")[0] for t in tab_values(events(tmp_path))}
    assert {"weights_nonfinite", "grads_nonfinite", "activations_nonfinite", "nonfinite", "activation_bytes",
            "saved_bytes", "grads_norm", "fwd_ms"} <= tab_families


def test_one_event_per_sampled_step(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=3) as ins:
        train(model, 7, ins)
    (path,) = tmp_path.glob("events.out.tfevents.*")
    steps = [e.step for e in LegacyEventFileLoader(str(path)).Load() if e.HasField("summary") and e.summary.value
             and e.summary.value[0].tag != "custom_scalars__config__"]
    assert steps == [0, 3, 6]


def test_update_ratio_with_optimizer(tmp_path, events):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as ins:
        x = torch.randn(32, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        ins.step()
    acc = events(tmp_path)
    for name, w in before.items():
        after = dict(model.named_parameters())[name].detach()
        expected = (after - w).norm().item() / after.norm().item()  # relative to the weights after the step
        assert acc.Scalars(f"update_ratio/{name}")[0].value == pytest.approx(expected, rel=1e-4)
        # gradients are read before the step, weights after it
        assert acc.Scalars(f"grads_norm/{name}")[0].value == pytest.approx(grads[name].norm().item(), rel=1e-5)
        assert acc.Scalars(f"weights_norm/{name}")[0].value == pytest.approx(after.norm().item(), rel=1e-5)


@pytest.mark.parametrize("families", [("weights", "updates"), ("updates",)], ids=["with-weights", "updates-only"])
def test_update_ratio_of_a_weight_that_starts_at_zero_is_finite(tmp_path, events, families):
    model = MLP()
    with torch.no_grad():
        model.fc2.bias.zero_()  # as BatchNorm biases and LoRA's B start
        model.fc1.bias.zero_()
    model.fc1.bias.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt, families=families) as ins:
        train(model, 1, ins, optimizer=opt)
    ratio = events(tmp_path).Scalars("update_ratio/fc2.bias")[0].value
    assert ratio == pytest.approx(1.0, rel=1e-5)  # ‖Δw‖ / ‖w after‖, w before = 0: the whole weight is the update


def test_frozen_and_tied_parameters(tmp_path, events):
    model = FrozenBackbone()
    with Inspector(model, log_dir=tmp_path / "frozen", every_n_steps=1) as ins:
        train(model, 1, ins)
    hists = events(tmp_path / "frozen").Tags()["histograms"]
    assert "weights/backbone.weight" in hists and "grads/backbone.weight" not in hists
    assert "grads/head.weight" in hists

    tied = TiedLM()
    opt = torch.optim.SGD(tied.parameters(), lr=0.1)
    with Inspector(tied, log_dir=tmp_path / "tied", every_n_steps=1) as ins:
        loss = tied(torch.randint(0, 20, (4, 5))).pow(2).mean()
        loss.backward()
        opt.step()
        ins.step()
    parameter_histograms = [t for t in events(tmp_path / "tied").Tags()["histograms"] if not t.startswith("activations/")]
    assert sorted(parameter_histograms) == ["grads/embed.weight", "weights/embed.weight"]


def test_losses_bitwise_identical_with_inspector(tmp_path):
    torch.manual_seed(1)
    plain = train(MLP(), 12, seed=3)
    torch.manual_seed(1)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt, stats=("mean", "std", "norm", "zero_frac")) as ins:
        watched = train(model, 12, ins, optimizer=opt, seed=3)
    assert watched == plain


def test_off_steps_register_nothing_and_touch_no_tensor(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ins = Inspector(model, log_dir=tmp_path, schedule=at_steps([2]), optimizer=opt, sentinel=False).start()
    module_hooks = 2 * len(list(model.modules()))  # pre and post: the layer table (first sample) and the probes
    for step in range(4):
        # the optimizer's step hooks for the whole run (they return at once off samples); module hooks only on
        # the sampled step, with the transformer probes' three on the model (when its forward begins and ends; the
        # kurtosis of its output, a block's)
        assert hook_count(model, opt) == 2 + (2 * module_hooks + 3 if step == 2 else 0)
        loss = model(torch.randn(4, 8)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with RecordTorchCalls() as calls:
            ins.step()
        if step == 1:  # arming step 2's probes reads parameter metadata, and the weights' NaN/Inf check: one fused norm
            metadata = {"numel", "device", "__get__", "requires_grad", "data_ptr", "storage_offset", "element_size"}
            check = {"detach", "_foreach_norm", "stack", "float", "_set_grad_enabled"}
            assert calls.calls and set(calls.calls) <= metadata | check, calls.calls
            assert calls.calls.count("_foreach_norm") == 1
        else:
            assert bool(calls.calls) == (step == 2), calls.calls[:5]
    ins.finish()
    assert hook_count(model, opt) == 0


def test_the_sentinel_is_the_only_work_on_an_off_step(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ins = Inspector(model, log_dir=tmp_path, schedule=at_steps([5]), optimizer=opt).start()
    for step in range(3):
        assert hook_count(model, opt) == 3  # step hooks, and the sentinel's count of optimizer steps (GradScaler skips)
        with RecordTorchCalls() as during:  # the sentinel checks in the optimizer's step pre-hook
            train(model, 1, optimizer=opt)
        with RecordTorchCalls() as after:
            ins.step()
        assert {c for c in after.calls if c not in ("__get__", "numel", "grad", "is_sparse")} == set(), after.calls
        # one fused kernel flags every gradient (no norm, no tensor per gradient); its flag read at once on the CPU
        assert during.calls.count("_amp_foreach_non_finite_check_and_unscale_") == 1 and "_foreach_norm" not in during.calls
        assert "item" in during.calls
    ins.finish()
    assert hook_count(model, opt) == 0


def test_finish_leaves_no_hook_is_idempotent_and_releases_the_model(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ins = Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt).start()
    train(model, 2, ins, optimizer=opt)
    # step 2 is armed: the optimizer's pre and post hooks, the probes' module hooks, the sentinel's step counter, and
    # on the model (its children are leaves) the transformer probes' begin and end hooks and the kurtosis probe's hook
    assert hook_count(model, opt) == 2 + 2 * len(list(model.modules())) + 1 + 2 + 1
    ins.finish()
    ins.finish()
    assert hook_count(model, opt) == 0
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    assert ref() is None


def test_model_collectable_while_inspector_alive(tmp_path):
    model = MLP()
    ins = Inspector(model, log_dir=tmp_path).start()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    ins.step()  # nothing left to log, nothing breaks
    ins.finish()


def test_user_exception_passes_through_and_hooks_are_removed(tmp_path, events):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="from the training loop"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as ins:
            train(model, 2, ins, optimizer=opt)
            raise Boom("from the training loop")
    assert hook_count(model, opt) == 0
    assert [e.step for e in events(tmp_path).Scalars("weights_norm/fc1.weight")] == [0, 1]


def test_user_writer_is_flushed_not_closed(tmp_path, events):
    writer = SummaryWriter(str(tmp_path))
    model = MLP()
    with Inspector(model, writer, every_n_steps=1) as ins:
        train(model, 1, ins)
    writer.add_scalar("after/finish", 1.0, 0)  # still open
    writer.close()
    assert "after/finish" in events(tmp_path).Tags()["scalars"]


def test_nonfinite_values_never_crash(tmp_path, events):
    model = MLP()
    with torch.no_grad():
        model.fc1.weight[0, 0] = math.nan
        model.fc1.weight[0, 1] = math.inf
    with Inspector(model, log_dir=tmp_path, every_n_steps=1) as ins:
        for _ in range(2):  # no optimizer step: 0 * NaN would spread the NaN to every weight
            model.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            ins.step()
    acc = events(tmp_path)
    assert acc.Scalars("weights_nonfinite/fc1.weight")[0].value == 2
    hist = acc.Histograms("weights/fc1.weight")[0].histogram_value
    assert hist.num == model.fc1.weight.numel() - 2 and math.isfinite(hist.max)
    assert math.isnan(acc.Scalars("layerwatch/grad_norm")[0].value)


def test_model_without_parameters_says_so_once(tmp_path):
    model = NoParams()
    with pytest.warns(RuntimeWarning, match="no parameters") as record:
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as ins:
            for _ in range(3):
                model(torch.randn(2, 3))
                ins.step()
    assert len([w for w in record if "no parameters" in str(w.message)]) == 1


def test_missing_gradients_are_explained_once(tmp_path):
    model = MLP()
    with pytest.warns(RuntimeWarning, match="before optimizer.zero_grad") as record:
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as ins:
            for _ in range(3):
                ins.step()
    assert len(layerwatch_messages(record)) == 1


def test_custom_scalars_charts_compare_layers_in_one_unit(tmp_path, events):
    import re

    from tensorboard.plugins.custom_scalar import layout_pb2

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as ins:
        train(model, 2, ins, optimizer=opt)
    acc = events(tmp_path)
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {cat.title: {c.title: c.multiline.tag[0] for c in cat.chart} for cat in layout.category}
    assert list(charts) == [f"layerwatch: {s}" for s in ("weights_norm", "grads_norm", "update_ratio", "fwd_ms", "bwd_ms")]
    scalars = acc.Tags()["scalars"]
    for category, by_title in charts.items():
        series = category.removeprefix("layerwatch: ")
        (regex,) = by_title.values()  # a small model: one chart holds every layer
        matched = sorted(t for t in scalars if re.match(regex, t))
        assert matched and {t.split("/")[0] for t in matched} == {series}  # one unit per chart
        assert matched == sorted(t for t in scalars if t.startswith(series + "/"))


def test_a_large_block_is_split_into_charts_that_do_not_overlap():
    from layerwatch.sinks.record import CHART_SERIES, custom_scalars_layout

    params = [f"layers.{i}.linear{j}.{p}" for i in range(12) for j in (1, 2) for p in ("weight", "bias")]
    modules = ["(root)", "layers"] + [f"layers.{i}" for i in range(12)] + [f"layers.{i}.linear{j}" for i in range(12) for j in (1, 2)]
    layout = custom_scalars_layout(params, modules, ("grads", "latency"), ("norm", "nonfinite"))
    assert set(layout) == {"layerwatch: grads_norm", "layerwatch: fwd_ms", "layerwatch: bwd_ms"}
    import re

    for category, series_names in (("grads_norm", params), ("fwd_ms", modules)):
        tags = [f"{category}/{n}" for n in series_names]
        charts = layout[f"layerwatch: {category}"]
        assert "layers.1" in charts and "layers.10" in charts
        placed = [t for _, (_, [regex]) in charts.items() for t in tags if re.match(regex, t)]
        assert sorted(placed) == sorted(tags)  # every layer in exactly one chart
        assert all(sum(1 for t in tags if re.match(regex, t)) <= CHART_SERIES for _, [regex] in charts.values())


def test_state_dict_resumes_the_schedule(tmp_path, events):
    model = MLP()
    first = Inspector(model, log_dir=tmp_path, every_n_steps=3).start()
    train(model, 4, first)
    state = first.state_dict()
    first.finish()
    assert state == {"step": 4}
    second = Inspector(model, log_dir=tmp_path, every_n_steps=3)
    second.load_state_dict(state)
    with second:
        train(model, 4, second)
    steps = sorted(e.step for e in events(tmp_path).Scalars("weights_norm/fc1.weight"))
    assert steps == [0, 3, 6]
    with pytest.raises(ValueError, match="got -1"):
        second.load_state_dict({"step": -1})


def test_a_failing_probe_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    from layerwatch import stats

    def broken(*args, **kwargs):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(stats, "reduce", broken)
    model = MLP()
    with pytest.warns(RuntimeWarning, match="probe exploded") as record:
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as ins:
            losses = train(model, 3, ins)
    assert len(losses) == 3
    messages = [str(w.message) for w in record]
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):  # each named once, not once per step
        assert sum(f"could not measure the gradients of {name!r}" in m for m in messages) == 1
        assert sum(f"could not measure the weights of {name!r}" in m for m in messages) == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(model="not a model"), TypeError, "model must be a torch.nn.Module, got str"),
        (dict(every_n_steps=0), ValueError, "every_n_steps must be an int >= 1, got 0"),
        (dict(every_n_steps=-5), ValueError, "got -5"),
        (dict(every_n_steps=2, schedule=[1]), ValueError, "every_n_steps=2, schedule=\\[1\\]"),
        (dict(writer="w", log_dir="x"), ValueError, "pass writer or log_dir, not both"),
        (dict(writer=object()), TypeError, "writer must be a SummaryWriter, got object"),
        (dict(optimizer="adam"), TypeError, "optimizer must be a torch.optim.Optimizer, got str"),
        (dict(families=("weights", "activation")), ValueError, "families: unknown value 'activation'"),
        (dict(modules=("fc*", 3)), TypeError, "modules: each entry must be a name pattern or an nn.Module type, got 3"),
        (dict(modules=[dict]), TypeError, "modules: dict is not an nn.Module subclass"),
        (dict(modules=[]), ValueError, "modules must name at least one pattern or type"),
        (dict(sentinel="on"), TypeError, "sentinel must be a bool, got 'on'"),
        (dict(stats=("median",)), ValueError, "stats: unknown value 'median'"),
        (dict(stats="norm"), TypeError, "the string 'norm'"),
        (dict(histogram_bins=1), ValueError, "histogram_bins must be an int in \\[2, 254\\], got 1"),
        (dict(histograms="yes"), TypeError, "histograms must be a bool, got 'yes'"),
    ],
)
def test_misuse_is_refused_at_construction(tmp_path, kwargs, error, match):
    kwargs = dict(kwargs)
    model = kwargs.pop("model", MLP())
    if "writer" not in kwargs and "log_dir" not in kwargs:
        kwargs["log_dir"] = tmp_path
    with pytest.raises(error, match=match):
        Inspector(model, **kwargs)


def test_unwritable_log_dir_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="a_file/runs' is not a writable directory"):
        Inspector(MLP(), log_dir=blocker / "runs")



@pytest.mark.parametrize("log_dir", ["", "  "])
def test_an_empty_log_dir_is_refused(tmp_path, log_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"log_dir must name a directory, got '{log_dir}'"):
        Inspector(MLP(), log_dir=log_dir)
    assert list(tmp_path.iterdir()) == []  # nothing written to the current directory


def test_step_before_start_and_after_finish(tmp_path):
    model = MLP()  # held by the test: the inspector only keeps a weak reference
    ins = Inspector(model, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"step\(\) called on an inspector that is new"):
        ins.step()
    ins.start()
    with pytest.raises(RuntimeError, match="start\\(\\) called on an inspector that is running"):
        ins.start()
    ins.finish()
    with pytest.raises(RuntimeError, match="that is finished"):
        ins.step()


def test_histograms_can_be_turned_off_and_families_chosen(tmp_path, events):
    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, histograms=False, families=("grads",)) as ins:
        train(model, 1, ins)
    tags = events(tmp_path).Tags()
    assert tags["histograms"] == []
    assert {t.split("/")[0] for t in tags["scalars"]} == {"grads_norm", "layerwatch"}


def test_a_failing_writer_is_warned_once_and_training_goes_on(tmp_path, monkeypatch, events):
    writer = SummaryWriter(str(tmp_path))
    model = MLP()
    with Inspector(model, writer, every_n_steps=1) as ins:
        train(model, 2, ins)

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(writer, "_get_file_writer", disk_full)
        with pytest.warns(RuntimeWarning, match="No space left on device") as record:
            losses = train(model, 3, ins)
    monkeypatch.undo()
    writer.close()
    assert len(losses) == 3 and len(record) == 1
    assert [e.step for e in events(tmp_path).Scalars("weights_norm/fc1.weight")] == [0, 1]  # nothing lost


def test_after_a_nan_the_norms_read_nan_not_a_vanished_layer(tmp_path, events):
    model = MLP()

    def poison(k):
        if k == 2:
            with torch.no_grad():
                model.fc1.weight[0, 0] = math.nan

    stats = ("mean", "std", "norm", "nonfinite")
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, stats=stats, alerts=False, sentinel=False) as inspector:
        train(model, 5, inspector, before_step=poison)
    acc = events(tmp_path)
    for tag in ("weights_norm/fc2.weight", "grads_norm/fc2.weight", "weights_mean/fc1.weight", "grads_std/fc1.bias"):
        values = {e.step: e.value for e in acc.Scalars(tag)}
        assert all(math.isfinite(values[k]) for k in (0, 1)), (tag, values)
        assert all(math.isnan(values[k]) for k in (3, 4)), (tag, values)  # not 0.0, read back from the file
    assert {e.step: e.value for e in acc.Scalars("weights_nonfinite/fc2.weight")}[4] > 0


def test_warnings_point_at_the_users_line(tmp_path, monkeypatch):
    from layerwatch.sinks.tensorboard import TensorBoardSink

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(TensorBoardSink, "write", broken)  # warned from inspector.step()
    model = HiddenMiddle()  # its probe fails: warned from a hook inside the forward
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, alerts=False) as inspector:
            loss = model(torch.randn(4, 8)).sum()
            loss.backward()
            inspector.step()
    ours = [w for w in seen if str(w.message).startswith("layerwatch")]
    assert any("could not write" in str(w.message) for w in ours)
    assert any("runtime probe failed" in str(w.message) for w in ours)
    assert all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]
