"""layerwatch stays out of compiled code: no hook body runs inside a Dynamo trace, and
attaching it adds no graph break, no graph and no recompile (counted by Dynamo itself).
The ``aot_eager`` backend needs no C++ compiler."""

import math
import warnings

import pytest
import torch
from torch import nn

from layerwatch import Inspector
from models import MLP, GradientSpoiler, Spoiler, compile_as, hook_count, layerwatch_messages, spoilable, tab_values

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402


HOWS = ["torch.compile(model)", "model.compile()", "torch.compile(loss_fn)"]


def run(log_dir, *, how, watch=True, steps=8, every=2, spoil_at=None, spoiler=None, backend="aot_eager",
        early_step=False, **options):
    """A small SGD run compiled ``how``; returns its losses (exact), final state, graphs (Dynamo's
    count), frames compiled after its first two steps (by Dynamo's counting backend), graph
    breaks and layerwatch's warnings. ``spoil_at``: the step from which the spoiler's buffer
    holds NaN. ``early_step``: one compiled training step runs before the Inspector exists."""
    from torch._dynamo.testing import CompileCounterWithBackend

    dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    spoiler = spoiler if spoiler is not None else Spoiler()
    model = spoilable(spoiler)
    call = compile_as(model, how, counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    forward = torch.compile(lambda x: call(x), backend=counter) if how == "torch.compile(loss_fn)" else call
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps + 1)]

    def train_step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    if early_step:
        train_step(*batches.pop())
    losses, after_two = [], 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inspector = Inspector(call, log_dir=log_dir, every_n_steps=every, optimizer=opt, **options).start() if watch else None
        for k, (x, y) in enumerate(batches[:steps]):
            if k == spoil_at:
                spoiler.scale.fill_(math.nan)
            losses.append(repr(train_step(x, y).item()))
            if inspector is not None:
                inspector.step()
            if k == 1:
                after_two = counter.frame_count
        alerts = [] if inspector is None else [a.message for a in inspector.alerts]
        if inspector is not None:
            inspector.finish()
    assert hook_count(model, opt) == 0
    return {
        "losses": losses, "state": [t.clone() for t in model.state_dict().values()],
        "graphs": counters["stats"]["unique_graphs"],
        "new_graphs": counter.frame_count - after_two, "breaks": sum(counters["graph_break"].values()),
        "graph_sizes": sorted(len(g.graph.nodes) for g in counter.graphs if len(g.graph.nodes)),
        "said": layerwatch_messages(seen), "alerts": alerts,
    }


def same_run(watched, plain):
    assert watched["losses"] == plain["losses"]  # bitwise, sampled steps too
    assert all(torch.equal(a, b) for a, b in zip(watched["state"], plain["state"]))


@pytest.mark.parametrize("how", HOWS)
def test_a_compiled_model_is_measured_inside_its_graph_with_one_graph_more_and_bitwise_losses(tmp_path, events, how):
    plain, watched = run(None, how=how, watch=False), run(tmp_path, how=how)
    same_run(watched, plain)
    assert watched["breaks"] == plain["breaks"] == 0
    assert plain["graphs"] <= watched["graphs"] <= plain["graphs"] + 1  # the armed variant
    assert watched["new_graphs"] == 0  # none after the first sampled step and the first between samples
    assert set(plain["graph_sizes"]) <= set(watched["graph_sizes"])  # between samples: the graph it would run anyway
    assert len(watched["said"]) == 1 and "compiled" in watched["said"][0]
    acc = events(tmp_path)
    tags = set(acc.Tags()["scalars"])
    for name in ("0", "1", "2", "3", "4", "5"):  # every module inside, at every sampled step
        assert [e.step for e in acc.Scalars(f"activations_norm/{name}")] == [0, 2, 4, 6], name
        assert f"activations/{name}" in acc.Tags()["histograms"], name
    assert [e.step for e in acc.Scalars("grads_norm/0.weight")] == [0, 2, 4, 6]
    assert not [t for t in tags if "_orig_mod" in t]
    latency = sorted(t for t in tags if t.startswith(("fwd_ms/", "bwd_ms/")))
    assert latency == (["bwd_ms/(root)", "fwd_ms/(root)"] if how == "torch.compile(model)" else [])
    tab = tab_values(acc)
    assert all(tab[f"activation_bytes/{name}"][6] == 16 * (16 if name in "01234" else 4) * 4 for name in "012345")
    saved = sorted(series for series in tab if series.startswith("saved_bytes/"))
    assert saved == (["saved_bytes/(root)"] if how == "torch.compile(model)" else [])  # the compiled part's, as a whole
    if saved:
        assert tab["saved_bytes/(root)"][6] > 0


def test_the_statistics_made_in_the_graph_are_the_eager_probes_statistics(tmp_path, events):
    """Step 0 (same weights, same batch): the compiled model's activation statistics and
    histograms against the eager run's."""
    every_stat = ("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")
    run(tmp_path / "eager", how="eager", steps=1, stats=every_stat)
    run(tmp_path / "compiled", how="torch.compile(model)", steps=1, stats=every_stat)
    eager, compiled = events(tmp_path / "eager"), events(tmp_path / "compiled")
    stats = [t for t in eager.Tags()["scalars"] if t.startswith("activations_") and not t.endswith("(root)")]
    assert len(stats) == 6 * 6  # nonfinite is a card of its own
    for tag in stats:
        assert compiled.Scalars(tag)[0].value == pytest.approx(eager.Scalars(tag)[0].value, rel=1e-5, abs=1e-6), tag
    for tag in [t for t in eager.Tags()["histograms"] if t.startswith("activations/")]:
        a, b = eager.Histograms(tag)[0].histogram_value, compiled.Histograms(tag)[0].histogram_value
        assert (a.min, a.max, a.num) == pytest.approx((b.min, b.max, b.num), rel=1e-6), tag
        assert sum(abs(x - y) for x, y in zip(a.bucket, b.bucket)) <= 0.01 * a.num, tag  # a value on an edge may move


@pytest.mark.parametrize("how", HOWS)
def test_a_nan_made_inside_compiled_code_on_a_sampled_step_names_its_module(tmp_path, how):
    watched = run(tmp_path, how=how, spoil_at=4, steps=5)
    assert "first offender: step 4, forward: 2 turned finite inputs into a non-finite output" in watched["alerts"]


def test_a_nan_made_in_the_compiled_backward_is_a_backward_offender(tmp_path):
    watched = run(tmp_path, how="torch.compile(model)", spoil_at=4, steps=5, spoiler=GradientSpoiler())
    assert ("first offender: step 4, backward: 2 turned finite gradient with respect to its outputs into a non-finite "
            "gradient with respect to its inputs (or parameters)") in watched["alerts"]


def test_hooks_attached_after_the_first_compiled_call_are_said_to_be_late_and_nothing_breaks(tmp_path, events):
    how = "torch.compile(model)"
    plain, watched = run(None, how=how, watch=False, early_step=True), run(tmp_path, how=how, early_step=True)
    same_run(watched, plain)
    said = [m for m in watched["said"] if "torch._dynamo.reset()" in m]
    assert len(said) == 1 and "compiled before layerwatch attached" in said[0], watched["said"]
    assert not [t for t in events(tmp_path).Tags()["scalars"] if t.startswith("activations_norm/0")]


def test_a_compiled_caller_that_ran_before_layerwatch_compiles_again_with_its_hooks(tmp_path, events):
    """The sampled step's forward guard replaces the model's ``forward``, which compiled code is
    guarded on: it compiles again, with the hooks (one graph, as attaching before would)."""
    how = "torch.compile(loss_fn)"
    plain, watched = run(None, how=how, watch=False, early_step=True), run(tmp_path, how=how, early_step=True)
    same_run(watched, plain)
    assert not [m for m in watched["said"] if "torch._dynamo.reset()" in m]
    assert [e.step for e in events(tmp_path).Scalars("activations_norm/0")] == [0, 2, 4, 6]


def test_inductor_compiled_model_is_measured_with_bitwise_losses(tmp_path, events):
    plain, watched = run(None, how="torch.compile(model)", watch=False, backend="inductor", steps=4), \
        run(tmp_path, how="torch.compile(model)", backend="inductor", steps=4)
    same_run(watched, plain)
    assert watched["breaks"] == 0 and watched["graphs"] == plain["graphs"] + 1 and watched["new_graphs"] == 0
    assert [e.step for e in events(tmp_path).Scalars("activations_norm/3")] == [0, 2]


def test_a_compiled_optimizer_step_is_not_traced_into(tmp_path, events):
    torch.manual_seed(0)
    dynamo.reset()
    counters.clear()
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = torch.compile(opt.step, backend="aot_eager")
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inspector = Inspector(model, log_dir=tmp_path, every_n_steps=3, optimizer=opt).start()
        for _ in range(9):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            step()
            inspector.step()
        inspector.finish()
    assert not [str(w.message) for w in seen if not str(w.message).startswith("layerwatch")]  # Dynamo warns of nothing
    said = layerwatch_messages(seen)
    assert len(said) == 1 and "step hooks did not run" in said[0]
    assert counters["stats"]["unique_graphs"] == 1
    acc = events(tmp_path)
    assert [e.step for e in acc.Scalars("grads_norm/fc1.weight")] == [0, 3, 6]  # read in step() instead
    assert [e.step for e in acc.Scalars("fwd_ms/fc1")] == [3, 6]  # probes are eager here (step 0: layer table)


L = pytest.importorskip("lightning.pytorch")


class CompilesItsNet(L.LightningModule):
    """A LightningModule that compiles its network in ``configure_model``, as Lightning advises."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.compiled = compiled
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def configure_model(self) -> None:
        if self.compiled:
            self.net = torch.compile(self.net, backend="aot_eager")

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_layer_has_one_name_compiled_or_not(tmp_path, events, compiled):
    from layerwatch import InspectCallback

    torch.manual_seed(0)
    dynamo.reset()
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, default_root_dir=str(tmp_path),
                        callbacks=[InspectCallback(every_n_steps=2)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(CompilesItsNet(compiled), torch.utils.data.DataLoader(data, batch_size=16))
    acc = events(tmp_path / "layerwatch")
    tags = acc.Tags()["scalars"]
    assert {"weights_norm/net.0.weight", "grads_norm/net.2.bias", "update_ratio/net.0.weight"} <= set(tags)
    assert not [t for t in tags if "_orig_mod" in t]
    for name in ("net", "net.0", "net.1", "net.2"):  # measured inside the compiled net too
        assert [e.step for e in acc.Scalars(f"activations_norm/{name}")] == [0, 2], name
    assert "fwd_ms/net" in tags and ("fwd_ms/net.0" in tags) is not compiled  # a compiled part is timed whole
