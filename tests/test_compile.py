"""layerwatch stays out of compiled code: no hook body runs inside a Dynamo trace, and
attaching it adds no graph break, no graph and no recompile (counted by Dynamo itself).
The ``aot_eager`` backend needs no C++ compiler."""

import math
import time
import warnings

import pytest
import torch
from torch import nn

from layerwatch import Inspector, summarize
from layerwatch.vocabulary import FAMILIES
from models import (MLP, BatchNormNet, Chain, GradientSpoiler, ReadsOnHost, Spoiler, TinyTransformer, compile_as, hook_count,
                    layerwatch_messages, run_state, same_state, spoilable, tab_values)

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
        "graph_code": [g.code for g in counter.graphs],
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


def test_a_second_run_compiles_the_very_graphs_of_the_first_so_inductors_caches_find_them(tmp_path):
    # Inductor's FX graph and AOTAutograd caches key on the graph's code, constants included: the
    # armed operator's probe is a small number, not an id() that differs in every process and run.
    first, second = (run(tmp_path / str(k), how="torch.compile(model)") for k in range(2))
    assert any("layerwatch.measure_call" in code for code in first["graph_code"])
    assert first["graph_code"] == second["graph_code"]


def test_a_compiled_model_in_bfloat16_is_told_once_that_its_sampled_steps_may_round_differently(tmp_path, events):
    # Measuring a module's output makes Inductor store it in bfloat16 where the unsampled graph may
    # keep it in float32 inside a fused kernel (a 2-block GPT-2 in bfloat16 under Inductor: step 0's
    # loss 5.540804 unwatched, 5.540761 watched; python benchmarks/compiled_gpt2.py --dtype bfloat16).
    dynamo.reset()
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inspector = Inspector(compiled, log_dir=tmp_path, every_n_steps=1).start()
        for _ in range(3):
            compiled(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            inspector.step()
        inspector.finish()
    said = [m for m in layerwatch_messages(seen) if "bfloat16 or float16" in m]
    assert len(said) == 1 and "families=" in said[0], layerwatch_messages(seen)
    assert [e.step for e in events(tmp_path).Scalars("activations_norm/fc1")] == [0, 1, 2]  # still measured


def test_a_compiled_optimizer_step_is_not_traced_into(tmp_path, events):
    """Dynamo never traces layerwatch's optimizer hooks. Python 3.11's Dynamo compiles the step
    with the hooks inside (traced, they do nothing: said once); 3.13's runs them eagerly around
    the compiled step, where they are marked never to be compiled (it traced them as frames of
    their own, a cached call warned of and ``.item()`` breaking a graph) and do their work."""
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
    # Dynamo warns of nothing (but of the Python it runs on: "Guards may run slower on Python 3.13.0")
    assert not [str(w.message) for w in seen if not str(w.message).startswith(("layerwatch", "Guards may run slower"))
                and not issubclass(w.category, DeprecationWarning)]
    said = layerwatch_messages(seen)
    assert counters["stats"]["unique_graphs"] == 1
    acc = events(tmp_path)
    if "update_ratio/fc1.weight" in acc.Tags()["scalars"]:  # the hooks ran, eagerly
        assert said == [] and [e.step for e in acc.Scalars("update_ratio/fc1.weight")] == [0, 3, 6]
    else:
        assert len(said) == 1 and "step hooks did not run" in said[0]
    assert [e.step for e in acc.Scalars("grads_norm/fc1.weight")] == [0, 3, 6]  # read in step() instead
    assert [e.step for e in acc.Scalars("fwd_ms/fc1")] == [3, 6]  # probes are eager here (step 0: layer table)


# ---------------------------------------------------------------------- the layer table, from input shapes

TABLE_HOWS = ["torch.compile(model)", "model.compile()", "a compiled part"]


def dropout_and_batchnorm() -> nn.Module:
    return Chain(BatchNormNet(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def images(g: torch.Generator) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=g)


def vectors(g: torch.Generator) -> torch.Tensor:
    return torch.randn(4, 8, generator=g)


def tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 40, (4, 6), generator=g)


TABLE_MODELS = pytest.mark.parametrize("make, batch", [(TinyTransformer, tokens), (dropout_and_batchnorm, images)],
                                       ids=["transformer", "dropout and batchnorm"])


def table_run(log_dir, make, batch, how, *, families=FAMILIES, replay=False, steps=4):
    """SGD steps of ``make()`` compiled ``how`` ("a compiled part": the model compiled, in a
    ``Chain`` of its own) in a plain loop, every second step sampled; the inspector (with a
    ``log_dir``) gets no replay closure unless ``replay``. Returns the losses (exact), the final
    state, Dynamo's counts, the run's state just before and just after the first sampled step's
    ``inspector.step()`` (which makes the table) and layerwatch's warnings."""
    from torch._dynamo.testing import CompileCounterWithBackend

    dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    torch.manual_seed(0)
    model = make()
    call = Chain(torch.compile(model, backend=counter)) if how == "a compiled part" else compile_as(model, how, counter)
    compiled_call = model.__dict__.get("_compiled_call_impl")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    batches = [batch(g) for _ in range(steps)]
    losses, around, after_two = [], [], 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inspector = None if log_dir is None else Inspector(call, log_dir=log_dir, every_n_steps=2, optimizer=opt,
                                                           families=families).start()
        for k, x in enumerate(batches):
            def loss_of(x=x):
                return call(x).float().pow(2).mean()

            if inspector is not None and replay:
                inspector.replay_with(loss_of)
            loss = loss_of()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(repr(loss.item()))
            if inspector is not None:
                around += [run_state(model)] if k == 0 else []
                inspector.step()
                around += [run_state(model)] if k == 0 else []
            if k == 1:
                after_two = counter.frame_count
        if inspector is not None:
            inspector.finish()
    assert hook_count(model, opt) == 0 and model.__dict__.get("_compiled_call_impl") is compiled_call
    return {
        "losses": losses, "state": [t.clone() for t in model.state_dict().values()], "around": around,
        "dynamo": {"graphs": counters["stats"]["unique_graphs"], "frames": counter.frame_count,
                   "new_frames": counter.frame_count - after_two, "breaks": sum(counters["graph_break"].values()),
                   "recompiles": sum(counters["recompiles"].values())},
        "said": layerwatch_messages(seen),
    }


def logged_table(acc) -> tuple[int, str]:
    """The step and text of the one layer table a run wrote, less the code block's indent."""
    (table,) = acc.Tensors("layerwatch/structure/text_summary")
    return table.step, "\n".join(line[4:] for line in table.tensor_proto.string_val[0].decode().splitlines())


def eager_table(make, batch, how):
    """``summarize`` of the model as built, uncompiled, on the run's first batch."""
    torch.manual_seed(0)
    model = make()
    return summarize(Chain(model) if how == "a compiled part" else model, batch(torch.Generator().manual_seed(1)))


@TABLE_MODELS
@pytest.mark.parametrize("how", TABLE_HOWS)
def test_a_compiled_models_layer_table_comes_from_its_input_shapes_in_a_plain_loop(tmp_path, events, how, make, batch):
    """No replay closure: the table comes from one forward of the first sampled step's input
    shapes under fake tensors. It is the eager model's (``summarize``), and the run is as without
    it: bitwise losses, the generators, buffers, gradients and modes as they were around the
    step that made it, and not one graph, frame, graph break or recompile more than the same run
    with the table off."""
    untabled_families = tuple(f for f in FAMILIES if f != "structure")
    plain = table_run(None, make, batch, how)
    untabled = table_run(tmp_path / "untabled", make, batch, how, families=untabled_families)
    watched = table_run(tmp_path / "watched", make, batch, how)
    assert watched["losses"] == untabled["losses"] == plain["losses"]
    assert all(torch.equal(a, b) for a, b in zip(watched["state"], plain["state"]))
    assert watched["dynamo"] == untabled["dynamo"] and watched["dynamo"]["new_frames"] == 0, (watched, untabled)
    before, after = watched["around"]
    assert same_state(before, after)
    assert len(watched["said"]) == 1 and "torch.compile'd" in watched["said"][0]
    expected = eager_table(make, batch, how)
    assert logged_table(events(tmp_path / "watched")) == (0, expected.to_text())
    assert [e.value for e in events(tmp_path / "watched").Scalars("layerwatch/macs_per_step")] == [expected.total_macs]
    assert expected.total_macs > 0 and "layerwatch/structure/text_summary" not in events(tmp_path / "untabled").Tags()["tensors"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # Dynamo's note of the graph break at .item()
@pytest.mark.parametrize("replay", [False, True], ids=["no replay", "replay_with"])
def test_a_forward_that_cannot_run_on_fake_tensors_falls_back_to_the_replay_and_says_so_once(tmp_path, events, replay):
    """``.item()`` in the forward: the table from shapes fails, which is said once; with a
    replay closure the table comes from one eager forward of the batch, else there is none.
    Training is as without layerwatch either way."""
    how = "torch.compile(model)"
    plain, watched = table_run(None, ReadsOnHost, vectors, how), table_run(tmp_path, ReadsOnHost, vectors, how, replay=replay)
    assert watched["losses"] == plain["losses"]
    said = [m for m in watched["said"] if "could not record the layer table of the compiled model from its input shapes" in m]
    assert len(said) == 1 and "DataDependentOutputException" in said[0] and "replay_with" in said[0], watched["said"]
    tensors = events(tmp_path).Tags()["tensors"]
    if replay:
        assert logged_table(events(tmp_path)) == (0, eager_table(ReadsOnHost, vectors, how).to_text())
    else:
        assert "layerwatch/structure/text_summary" not in tensors


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
    step, table = logged_table(acc)  # compiled: training_step calls no module of its own, so from the replay
    assert step == 0 and "    0 (Linear)" in table and "_orig_mod" not in table


def test_overhead_ms_counts_the_operator_inside_compiled_code(tmp_path, monkeypatch, events):
    """The traced probe's operator runs inside the compiled forward, where no hook's clock is:
    its host time is timed in its body and counts in the sampled step's ``overhead_ms``."""
    from layerwatch.probes.traced import TracedProbe

    delay, measured = 0.005, []
    original = TracedProbe.measure

    def slow(self, outputs, inputs, index):
        time.sleep(delay)
        measured.append(index)
        original(self, outputs, inputs, index)

    monkeypatch.setattr(TracedProbe, "measure", slow)
    run(tmp_path, how="torch.compile(model)", steps=4, every=2)
    reported = [s.value for s in events(tmp_path).Scalars("layerwatch/overhead_ms")]
    calls = len(measured) // len(reported)  # the same modules at each sampled step
    assert calls >= 1 and len(reported) == 2, (measured, reported)
    assert all(ms >= 1e3 * delay * calls for ms in reported), (reported, calls)
