"""The per-module runtime probes and the NaN sentinel (issue 4)."""

import gc
import math
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from layerwatch import Inspector, at_steps
from layerwatch.probes import RuntimeProbe, select_modules
from layerwatch.probes.evidence import SpreadWork
from layerwatch.probes.terms import ProbeTerms
from models import (
    Amplifier, InPlaceCheckpointed, MLP, HiddenMiddle, Poison, SharedLayer, hook_count, tab_values, train, train_through_overflow_in_a_module,
    train_through_scaler_overflow,
)

NO_TABLE = ("weights", "grads", "latency", "memory", "activations", "nonfinite")  # timed from the first sample


def scalar(acc, tag: str, step: int) -> float:
    """A value at ``step``: from its card, or from the LAYERWATCH tab's data (the byte series,
    and the NaN/Inf series of a layer that has not been non-finite, are not cards)."""
    card = [e.value for e in acc.Scalars(tag) if e.step == step] if tag in acc.Tags()["scalars"] else []
    if card:
        (value,) = card
        return value
    return tab_values(acc)[tag][step]


class Sqrt(nn.Module):
    """sqrt: finite forward at 0, infinite gradient there (a backward-only fault after a ReLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sqrt()


def wide_nested(d: int = 384) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(d, d), nn.Tanh(), nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)), nn.Linear(d, d)
    )


def test_a_container_takes_its_childrens_time_and_agrees_with_the_profiler(tmp_path, events):
    model = wide_nested()
    x = torch.randn(1024, 384)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, families=NO_TABLE) as inspector:
        for _ in range(2):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                model(x).square().mean().backward()
            inspector.step()
    acc = events(tmp_path)
    fwd = {name: scalar(acc, f"fwd_ms/{name}", 1) for name in ("(root)", "0", "1", "2", "2.0", "2.1", "2.2", "3")}
    bwd = {name: scalar(acc, f"bwd_ms/{name}", 1) for name in ("(root)", "2", "2.0", "2.2")}
    # A container's time is its children's sum plus its own glue (a Sequential has next to none).
    assert fwd["2"] == pytest.approx(fwd["2.0"] + fwd["2.1"] + fwd["2.2"], rel=0.15, abs=0.1)
    assert fwd["(root)"] == pytest.approx(fwd["0"] + fwd["1"] + fwd["2"] + fwd["3"], rel=0.15, abs=0.1)
    assert bwd["(root)"] >= bwd["2"] >= 0.9 * (bwd["2.0"] + bwd["2.2"])
    # The profiler's own measure of each Linear's op on the same step, in forward order.
    linears = [e.cpu_time_total / 1e3 for e in prof.events() if e.name == "aten::linear"]
    assert len(linears) == 4
    for name, profiled in zip(("0", "2.0", "2.2", "3"), linears):
        assert fwd[name] == pytest.approx(profiled, rel=0.3, abs=0.15), name


def test_exact_bytes_returned_and_saved_for_backward(tmp_path, events):
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=16, d_out=4)  # fc1 -> act (ReLU) -> fc2
    with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
        train(model, 1, inspector)  # a batch of 32
    acc = events(tmp_path)
    f32 = 4
    assert scalar(acc, "activation_bytes/fc1", 0) == 32 * 16 * f32
    assert scalar(acc, "activation_bytes/act", 0) == 32 * 16 * f32
    assert scalar(acc, "activation_bytes/fc2", 0) == 32 * 4 * f32
    assert scalar(acc, "activation_bytes/(root)", 0) == 32 * 4 * f32
    # fc1 keeps its input for its weight's gradient (its weight is a parameter: not counted);
    # the ReLU keeps its output; fc2's input is that same storage, counted once, by the ReLU.
    assert scalar(acc, "saved_bytes/fc1", 0) == 32 * 8 * f32
    assert scalar(acc, "saved_bytes/act", 0) == 32 * 16 * f32
    assert scalar(acc, "saved_bytes/fc2", 0) == 0
    assert scalar(acc, "saved_bytes/(root)", 0) == 32 * 8 * f32 + 32 * 16 * f32
    assert "cuda_alloc_bytes/fc1" not in acc.Tags()["scalars"]  # a GPU measure only


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_saved_bytes_count_every_micro_batch_of_an_accumulated_step(tmp_path, events, micro_batches):
    """Under gradient accumulation each micro-batch's forward saves its own tensors, and a
    storage freed by one micro-batch's backward is often handed out again, at the same address,
    to the next one: each is counted, so the step's value is the single micro-batch's times k."""
    f32 = 4
    single = {"fc1": 32 * 8 * f32, "act": 32 * 16 * f32, "fc2": 0, "(root)": 32 * 8 * f32 + 32 * 16 * f32}
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=16, d_out=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
        for _ in range(2):  # two optimizer steps, both sampled
            for _ in range(micro_batches):
                (model(torch.randn(32, 8)).pow(2).mean() / micro_batches).backward()
            opt.step()
            inspector.step()
            opt.zero_grad()
    acc = events(tmp_path)
    for step in (0, 1):
        assert {name: scalar(acc, f"saved_bytes/{name}", step) for name in single} == {
            name: micro_batches * nbytes for name, nbytes in single.items()}, step


def test_activation_stats_and_histogram_match_numpy(tmp_path, events):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(32, 8)
    expected = model.fc1(x).detach().numpy().ravel()
    stats = ("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, stats=stats) as inspector:
        model(x).sum().backward()
        inspector.step()
    acc = events(tmp_path)
    for stat, value in {"mean": expected.mean(), "std": expected.std(), "min": expected.min(), "max": expected.max(),
                        "norm": np.linalg.norm(expected), "zero_frac": 0.0, "nonfinite": 0.0}.items():
        assert scalar(acc, f"activations_{stat}/fc1", 0) == pytest.approx(value, rel=1e-4, abs=1e-6), stat
    assert scalar(acc, "activations_zero_frac/act", 0) == pytest.approx((expected <= 0).mean())
    hist = acc.Histograms("activations/fc1")[0].histogram_value
    assert hist.num == expected.size == sum(hist.bucket)
    assert "activations/(root)" in acc.Tags()["histograms"]


def test_a_large_output_gets_a_sampled_histogram_and_exact_stats(tmp_path, events, monkeypatch):
    monkeypatch.setattr("layerwatch.probes.outputs.HISTOGRAM_VALUES", 500)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(256, 8)
    expected = model.fc1(x).detach().numpy().ravel()  # 4096 values
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, stats=("mean", "max", "norm")) as inspector:
        model(x).sum().backward()
        inspector.step()
    acc = events(tmp_path)
    for stat, value in {"mean": expected.mean(), "max": expected.max(), "norm": np.linalg.norm(expected)}.items():
        assert scalar(acc, f"activations_{stat}/fc1", 0) == pytest.approx(value, rel=1e-5), stat
    hist = acc.Histograms("activations/fc1")[0].histogram_value
    assert hist.num == expected.size and sum(hist.bucket) == pytest.approx(expected.size)
    assert (hist.min, hist.max) == pytest.approx((expected.min(), expected.max()))
    assert len([c for c in hist.bucket if c]) > 10  # a shape, not one lump


@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nan-and-inf"])
def test_an_accelerators_masked_statistics_of_a_large_output_are_the_hosts(poisoned):
    """A large output's statistics are read at once on the CPU and made by masked ops on an
    accelerator (no host read); both are over the finite values alone, variance included."""
    from layerwatch import stats as S
    from layerwatch.probes.outputs import Outputs

    torch.manual_seed(0)
    flat = torch.randn(50_000) * 3 + 1
    if poisoned:
        flat[[7, 9000]] = torch.tensor([math.nan, math.inf])
    outputs = Outputs(32, zeros=True, centered=True, workspace=S.Workspace())
    host, host_extremes = outputs._read_at_once(flat)
    device, device_extremes = outputs._masked(flat)
    np.testing.assert_allclose(device.numpy(), host, rtol=1e-5)
    assert torch.equal(device_extremes, host_extremes)
    finite = flat[torch.isfinite(flat)].double()
    assert host[0] == finite.numel() and host[-1] == pytest.approx(finite.var(correction=0).item(), rel=1e-5)


def test_a_large_output_with_no_finite_value_is_measured_without_a_warning():
    """Inside a training step the hook must stay quiet: no variance of zero values (torch warns)."""
    from layerwatch import stats as S
    from layerwatch.probes.outputs import Outputs

    outputs = Outputs(32, zeros=True, centered=True, workspace=S.Workspace())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats, extremes = outputs._read_at_once(torch.full((50_000,), math.nan))
    assert stats[0] == 0 and (stats[1], stats[2]) == (math.inf, -math.inf) and math.isnan(stats[-1])
    assert extremes.tolist() == [math.inf, -math.inf]


def test_first_offender_is_the_module_that_made_the_nan_not_one_upstream(tmp_path, events):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Poison(step=3), nn.Linear(8, 8), nn.ReLU())
    with pytest.warns(RuntimeWarning, match=r"first offender: step 3, forward: 1 turned finite inputs into a non-finite output"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            train(model, 5, inspector)
    acc = events(tmp_path)
    assert [scalar(acc, f"nonfinite/{m}", 2) for m in ("0", "1", "2", "3")] == [0, 0, 0, 0]
    assert [scalar(acc, f"nonfinite/{m}", 3) for m in ("0", "1", "2", "3")] == [1, 1, 1, 1]  # 0: its gradient
    assert scalar(acc, "layerwatch/nonfinite_modules", 3) == 5  # and the root
    (text,) = acc.Tensors("layerwatch/first_offender/text_summary")
    assert text.step == 3
    assert text.tensor_proto.string_val[0].decode() == "step 3, forward: 1 turned finite inputs into a non-finite output"
    assert [(a.kind, a.name, a.step) for a in inspector.alerts][0] == ("nonfinite", "1", 3)


def test_a_backward_only_fault_is_named_in_the_backward_phase(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Sqrt(), nn.Linear(8, 1))
    with pytest.warns(RuntimeWarning, match=r"step 0, backward: 2 turned finite gradient with respect to its outputs"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, sentinel=False) as inspector:
            loss = model(torch.randn(32, 8)).sum()
            assert torch.isfinite(loss)
            loss.backward()
            inspector.step()
    assert inspector.alerts[0].name == "2"


def test_the_sentinel_reports_a_nan_between_samples_and_arms_the_next_step(tmp_path, events):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Poison(step=7), nn.Linear(8, 4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=tmp_path, schedule=at_steps([0, 100])) as inspector:
            train(model, 12, inspector)
    acc = events(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("layerwatch/first_nonfinite_step")] == [(7, 7.0)]
    assert [e.step for e in acc.Scalars("fwd_ms/0")] == [8]  # step 0 recorded the layer table; 8 was armed
    sentinel = [str(w.message) for w in seen if "the sentinel" in str(w.message)]
    assert len(sentinel) == 1 and "NaN/Inf gradients at step 7" in sentinel[0] and "0.weight" in sentinel[0]
    # SGD spread step 7's NaN into the weights: step 8's first module to use one is said to be
    # just that, never "the first offender" (no replay was offered)
    assert "layerwatch/first_offender/text_summary" not in acc.Tags()["tensors"]
    (alert,) = [a for a in inspector.alerts if a.kind == "nonfinite" and a.name == "0"]
    assert alert.step == 8 and alert.message.startswith("first module to use a non-finite weight at step 8: 0 (0.weight")
    assert "The fault happened at step 7, between samples" in alert.message and "replay_with" in alert.message


def test_the_sentinel_can_be_turned_off(tmp_path, events):
    model = nn.Sequential(nn.Linear(8, 8), Poison(step=2), nn.Linear(8, 4))
    with Inspector(model, log_dir=tmp_path, schedule=at_steps([0]), sentinel=False) as inspector:
        train(model, 5, inspector)
    assert "layerwatch/first_nonfinite_step" not in events(tmp_path).Tags()["scalars"]


def test_a_grad_scaler_skip_does_not_fire_the_sentinel(tmp_path, events):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Inspector(model, log_dir=tmp_path, schedule=at_steps([3]), optimizer=opt) as inspector:
        train_through_scaler_overflow(model, opt, 3, inspector)
    assert "layerwatch/first_nonfinite_step" not in events(tmp_path).Tags()["scalars"]


def test_a_module_whose_backward_overflows_on_a_grad_scaler_skip_is_no_offender(tmp_path, events):
    # an fp16 matmul's overflow under a GradScaler's first scale, as seen on a GPU: the probes see
    # a module turn a finite gradient non-finite, but the optimizer skips the step: no fault
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Amplifier(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
        train_through_overflow_in_a_module(model, opt, 4, inspector)
    assert inspector.alerts == []
    acc = events(tmp_path)
    assert [e.step for e in acc.Scalars("layerwatch/optimizer_skipped")][:1] == [0]
    assert "layerwatch/first_nonfinite_step" not in acc.Tags()["scalars"]
    assert not [t for t in acc.Tags().get("tensors", []) if "first_offender" in t]


def test_in_place_ops_and_checkpointing_keep_bitwise_losses_and_get_backward_times(tmp_path, events):
    torch.manual_seed(0)
    plain = train(InPlaceCheckpointed(), 4)
    torch.manual_seed(0)
    model = InPlaceCheckpointed()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
        watched = train(model, 4, inspector)
    assert watched == plain
    tags = events(tmp_path).Tags()["scalars"]
    assert {"bwd_ms/a", "bwd_ms/act", "bwd_ms/block", "bwd_ms/head", "bwd_ms/(root)"} <= set(tags)
    assert hook_count(model) == 0


def test_a_module_called_twice_adds_up_its_calls(tmp_path, events):
    model = SharedLayer()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, families=NO_TABLE) as inspector:
        train(model, 2, inspector)
    acc = events(tmp_path)
    assert scalar(acc, "calls/layer", 1) == 2
    assert "calls/out" not in acc.Tags()["scalars"]  # called once: no card
    assert scalar(acc, "activation_bytes/layer", 1) == 2 * 32 * 8 * 4


@pytest.mark.parametrize(
    "modules, expected",
    [(["fc*"], {"fc1", "fc2"}), ([nn.ReLU], {"act"}), (["(root)", nn.ReLU], {"(root)", "act"})],
)
def test_modules_restricts_the_probes(modules, expected, tmp_path, events):
    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, modules=modules) as inspector:
        train(model, 1, inspector)
    probed = {t.split("/", 1)[1] for t in tab_values(events(tmp_path)) if t.startswith("activation_bytes/")}
    assert probed == expected


def test_a_filter_that_matches_nothing_is_said_once(tmp_path):
    model = MLP()
    with pytest.warns(RuntimeWarning, match=r"modules=\['encoder\.\*'\] matches no module"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, modules=["encoder.*"]) as inspector:
            train(model, 3, inspector)


def test_families_off_arm_no_module_hook(tmp_path, events):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, families=("weights", "grads"), sentinel=False) as inspector:
        for _ in range(2):
            assert hook_count(model, opt) == 0
            train(model, 1, optimizer=opt)
            inspector.step()
    acc = events(tmp_path)
    families = {t.split("/")[0] for t in [*acc.Tags()["scalars"], *tab_values(acc)]}
    assert families.isdisjoint({"fwd_ms", "bwd_ms", "activation_bytes", "saved_bytes", "nonfinite", "activations_norm"})


def test_only_latency_still_times_every_level(tmp_path, events):
    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, families=("latency",)) as inspector:
        train(model, 2, inspector)
    acc = events(tmp_path)
    tags = [*acc.Tags()["scalars"], *tab_values(acc)]
    assert {"fwd_ms/(root)", "fwd_ms/fc1", "bwd_ms/fc1", "bwd_ms/(root)"} <= set(tags)
    assert not any(t.startswith(("activation_bytes/", "nonfinite/", "activations_")) for t in tags)


def test_the_layer_table_step_leaves_out_times_only(tmp_path, events):
    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
        train(model, 2, inspector)
    acc = events(tmp_path)
    assert [e.step for e in acc.Scalars("fwd_ms/fc1")] == [1]  # step 0 ran under FlopCounterMode
    assert sorted(tab_values(acc)["activation_bytes/fc1"]) == [0, 1]


def test_validation_forwards_are_not_probed(tmp_path, events):
    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, families=NO_TABLE) as inspector:
        with torch.no_grad():
            model(torch.randn(4, 8))  # a different batch size: would change the byte counts
        train(model, 1, inspector)
    assert scalar(events(tmp_path), "activation_bytes/fc1", 0) == 32 * 16 * 4


def test_a_failing_probe_is_warned_once_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    plain = train(HiddenMiddle(), 4)
    torch.manual_seed(0)
    model = HiddenMiddle()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            watched = train(model, 4, inspector)
    assert watched == plain
    failures = [str(w.message) for w in seen if "runtime probe failed" in str(w.message)]
    assert len(failures) == 1 and "Opaque does not support" in failures[0]
    assert hook_count(model) == 0


def test_a_saved_tensor_changed_in_place_still_raises_like_autograd(tmp_path):
    class Bad(nn.Module):
        def forward(self, x):
            y = x * 1
            out = y.sin()  # saves y
            y.add_(1)
            return out

    model = nn.Sequential(nn.Linear(4, 4), Bad())
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, families=("memory",)) as inspector:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            model(torch.randn(2, 4)).sum().backward()
        inspector.step()


def test_the_callback_probes_modules_of_the_lightning_module(tmp_path, events):
    from layerwatch import InspectCallback
    from models import LitMLP
    from models import make_trainer

    torch.manual_seed(0)
    callback = InspectCallback(every_n_steps=2, modules=["net.*"])
    make_trainer(tmp_path, [callback], max_steps=5).fit(LitMLP())
    acc = events(tmp_path / "tb" / "version_0")
    tags = {*acc.Tags()["scalars"], *tab_values(acc)}
    assert {"fwd_ms/net.0", "bwd_ms/net.2", "saved_bytes/net.1", "nonfinite/net.0"} <= tags
    assert not any(t.endswith("/(root)") or t.endswith("/net") for t in tags)  # not matched by "net.*"


def test_the_garbage_collector_is_never_switched_off(tmp_path):
    import gc

    model = MLP()
    seen = []
    model.fc1.register_forward_hook(lambda *_: seen.append(gc.isenabled()))
    with Inspector(model, log_dir=tmp_path, schedule=at_steps([1])) as inspector:
        train(model, 3, inspector)
        assert gc.isenabled()
    assert seen == [True, True, True] and gc.isenabled()


def test_a_large_output_with_a_nan_reads_nan_and_keeps_a_histogram_of_its_finite_values(tmp_path, events, monkeypatch):
    monkeypatch.setattr("layerwatch.probes.outputs.HISTOGRAM_VALUES", 500)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(256, 8)
    x[0, 0] = math.nan  # one NaN in fc1's 4096-value output row 0
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, stats=("mean", "max", "nonfinite"), sentinel=False,
                   alerts=False) as inspector:
        model(x).sum().backward()
        inspector.step()
    expected = model.fc1(x).detach().numpy().ravel()
    finite = expected[np.isfinite(expected)]
    acc = events(tmp_path)
    assert scalar(acc, "activations_nonfinite/fc1", 0) == expected.size - finite.size
    assert math.isnan(scalar(acc, "activations_mean/fc1", 0))  # never a healthy-looking number
    hist = acc.Histograms("activations/fc1")[0].histogram_value
    assert math.isfinite(hist.min) and math.isfinite(hist.max) and hist.max == pytest.approx(finite.max())
    assert hist.num == finite.size and hist.sum == pytest.approx(finite.sum(), rel=1e-4, abs=1e-4)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def forward(self, x):
        return x + self.mlp(x)  # a new tensor: the residual stream


class ResidualStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Residual(), Residual())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_the_residual_stream_gets_an_activation_histogram(tmp_path, events):
    torch.manual_seed(0)
    model, x = ResidualStack(), torch.randn(16, 8)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, stats=("mean", "norm"), alerts=False) as inspector:
        model(x).sum().backward()
        inspector.step()
    with torch.no_grad():
        stream = model.blocks[0](x)
        out = model.blocks[1](stream)
    acc = events(tmp_path)
    tags = acc.Tags()["histograms"]
    assert {"activations/blocks.0", "activations/blocks.1", "activations/blocks"} <= set(tags)
    assert scalar(acc, "activations_mean/blocks.0", 0) == pytest.approx(stream.mean().item(), rel=1e-5)
    assert scalar(acc, "activations_norm/blocks.1", 0) == pytest.approx(out.norm().item(), rel=1e-5)
    assert scalar(acc, "activations_norm/blocks", 0) == scalar(acc, "activations_norm/blocks.1", 0)  # one reduction, shared
    assert acc.Histograms("activations/blocks.0")[0].histogram_value.num == stream.numel()


def test_a_probed_module_leaves_few_objects_for_the_garbage_collector():
    """The collector walks every object alive on each of its collections: the hooks keep ints,
    not tuples, lists, closures or handles per module call (on 600 modules those cost more
    than the hooks did)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(100)])  # 301 modules
    x = torch.randn(4, 8)
    families = ("latency", "memory", "activations", "nonfinite")

    def arm() -> RuntimeProbe:
        return RuntimeProbe(select_modules(model, None), families=families, bins=32, zeros=False, centered=False,
                            parameters=list(model.parameters()))

    probe = arm()  # a first step makes what torch keeps (the parameters' storage objects)
    model(x).sum().backward()
    probe.result()
    arming, forward = [], []
    for _ in range(3):  # the least of three: another thread of the test process may allocate meanwhile
        gc.collect()
        before = len(gc.get_objects())
        probe = arm()
        armed = len(gc.get_objects())
        out = model(x).sum()
        gc.collect()
        arming.append(armed - before)
        forward.append(len(gc.get_objects()) - armed)
        out.backward()
        result = probe.result()
        assert len(result.modules) == 301 and all(t.bwd_ms is not None for t in result.modules)
    assert min(arming) < 50, arming  # one hook pair for every module: no handle per module
    # Per module: its two gradient hooks and their handles, the tensors' hook dicts, its saved
    # tensor's alias and its storage (about 35 objects before).
    assert min(forward) < 9 * 301, forward


def test_a_model_deep_copied_during_a_sampled_step_trains_and_is_passed_over(tmp_path):
    """An EMA or SWA copy made while the step's hooks are on: the copy carries them, runs, and
    is not measured (nor is the probe copied with it)."""
    import copy

    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 8)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, sentinel=False, alerts=False) as inspector:
        model(x).sum().backward()
        twin = copy.deepcopy(model)
        twin(x).sum().backward()
        inspector.step()
    assert torch.equal(twin(x), model(x))
    assert hook_count(model) == 0


def test_the_gpu_clock_reuses_its_events_from_one_sampled_step_to_the_next():
    """On a GPU a hook records an event kept from earlier steps (a fake event here: this
    machine has no GPU; tests/test_gpu.py runs the real one)."""
    from layerwatch.probes.clocks import CudaClock

    class FakeEvent:
        made = 0

        def __init__(self) -> None:
            FakeEvent.made += 1
            self.at = None

        def record(self) -> None:
            self.at = time.perf_counter()

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, later: "FakeEvent") -> float:
            return 1e3 * (later.at - self.at)

    events: list = []
    clock = CudaClock(events, make=FakeEvent)
    marks = [clock.mark() for _ in range(4)]
    assert marks == [0, 1, 2, 3] and FakeEvent.made == 4
    times = clock.resolve(marks)
    assert times[0] == 0 and list(times) == sorted(times)
    clock = CudaClock(events, make=FakeEvent)  # the next sampled step
    assert clock.resolve([clock.mark() for _ in range(6)]).shape == (6,)
    assert FakeEvent.made == 6  # four reused, two new


def test_the_users_saved_tensor_hooks_still_pack_what_autograd_saves(tmp_path, events):
    """An offload (``save_on_cpu``) or any saved-tensor hooks a user wraps the forward in keep
    packing every saved tensor on a sampled step: the probes count the bytes and pass them on."""
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.clone()  # what an offload does: autograd keeps the packed copy, not t

    def forward_and_backward(model):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(torch.randn(32, 8)).pow(2).mean()
        loss.backward()
        return loss.item()

    torch.manual_seed(0)
    plain = MLP(d_in=8, hidden=16, d_out=4)
    inspected = MLP(d_in=8, hidden=16, d_out=4)
    inspected.load_state_dict(plain.state_dict())
    torch.manual_seed(1)
    expected = forward_and_backward(plain)
    unprobed = len(packed)
    packed.clear()
    with Inspector(inspected, log_dir=tmp_path, every_n_steps=1) as inspector:
        torch.manual_seed(1)
        assert forward_and_backward(inspected) == expected
        inspector.step()
    assert len(packed) == unprobed > 0
    assert scalar(events(tmp_path), "saved_bytes/(root)", 0) == 32 * 8 * 4 + 32 * 16 * 4


class Spoil(nn.Module):
    """Identity, or (``on``) one value of its output NaN: a NaN made from finite inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.where(torch.arange(x.shape[-1]) == 0, math.nan, 1.0) if self.on else x


class PoisonedWeights(nn.Module):
    """Token ids into an embedding, a linear layer, a :class:`Spoil`, and a second linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.first = nn.Linear(8, 8)
        self.spoil = Spoil()
        self.second = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.second(self.spoil(self.first(self.embed(ids))))


@pytest.mark.parametrize("how", ["eager", "torch.compile(model)", "model.compile()"])
@pytest.mark.parametrize("poisoned", ["embed", "second"])
def test_a_module_whose_weights_were_non_finite_is_never_named_the_first_offender(how, poisoned, tmp_path):
    """The sentinel off, a weight NaN before the sampled step (as an optimizer leaves it after
    an unseen fault): the first module to compute with it turns finite inputs (token ids, or
    finite activations) into NaN, and is named as the first to *use* a non-finite weight."""
    from models import compile_as

    torch._dynamo.reset()
    model = PoisonedWeights()
    call = compile_as(model, how, "aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with Inspector(call, log_dir=tmp_path, schedule=at_steps([2]), optimizer=opt, sentinel=False) as inspector:
            for k in range(3):
                opt.zero_grad()
                call(torch.arange(16).reshape(4, 4)).pow(2).mean().backward()
                opt.step()
                if k == 1:  # as the optimizer leaves it, after a fault in step 1's gradients
                    with torch.no_grad():
                        getattr(model, poisoned).weight[0, 0] = math.nan
                inspector.step()
    named = [a for a in inspector.alerts if a.kind == "nonfinite" and not a.message.startswith("NaN/Inf values")]
    assert [(a.step, a.name) for a in named] == [(2, poisoned)], named
    assert named[0].message.startswith(f"first module to use a non-finite weight at step 2: {poisoned} ({poisoned}.weight "
                                       "held NaN/Inf before the step's forward). The fault happened before step 2, where "
                                       "no probe saw it")
    assert not any("first offender" in a.message for a in inspector.alerts)


def test_a_module_that_makes_a_nan_from_finite_weights_is_named_though_other_weights_are_non_finite(tmp_path):
    model = PoisonedWeights()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, schedule=at_steps([1]), optimizer=opt, sentinel=False) as inspector:
        for k in range(2):
            model.spoil.on = k == 1
            opt.zero_grad()
            model(torch.arange(16).reshape(4, 4)).pow(2).mean().backward()
            opt.step()
            if k == 0:
                with torch.no_grad():
                    model.second.weight[0, 0] = math.nan
            inspector.step()
    named = [a for a in inspector.alerts if a.kind == "nonfinite" and not a.message.startswith("NaN/Inf values")]
    assert [(a.step, a.name, a.message.split(": ")[0]) for a in named] == [(1, "spoil", "first offender")]


@pytest.mark.parametrize("terms", [
    ProbeTerms(False), ProbeTerms(True), ProbeTerms(True, True, SpreadWork(2, 1, 7, 3, 2**32 - 1), -1),
    ProbeTerms(True, True, SpreadWork(), 123456), ProbeTerms(False, True, SpreadWork(0, 4, 0, 9, 5), 0),
])
def test_what_the_ranks_agree_on_is_one_vector_of_the_same_length_whatever_its_values(terms):
    vector = terms.vector()
    assert len(vector) == ProbeTerms.width() == 8  # every rank sends as many ints, or the all_reduce mismatches
    assert all(type(v) is int for v in vector)
    assert ProbeTerms.from_vector(vector) == terms
    with pytest.raises(ValueError):
        ProbeTerms.from_vector(vector[:-1])
