"""layerwatch never runs inside compiled code. A compiled run with it is the run without it: the
same losses and final weights bit for bit, in float32, bfloat16 and float16 (under autocast, and
with the weights in that dtype), dropout on, and the same graphs, graph breaks and recompiles
(Dynamo's own counts), whichever way the model is compiled. A compiled model's sampled step is
measured on an eager, forward-only re-run of one micro-batch (``rerun.py``), and what that gives
is what an eager step gives. Inductor is the compiler where bits can move (it fuses, and keeps
float32 inside a fused kernel); ``aot_eager`` serves where only what is measured is checked."""

import math
import time
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layerwatch import Inspector, summarize
from layerwatch.vocabulary import FAMILIES
from models import (MLP, BatchNormNet, Chain, GradientSpoiler, ReadsOnHost, SdpaLM, Spoiler, TinyTransformer, compile_as,
                    hook_count, layerwatch_messages, run_state, same_state, tab_values, train_step)

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

HOWS = ["torch.compile(model)", "model.compile()", "each block compiled", "torch.compile(loss_fn)"]
DTYPES = {  # name: (autocast dtype, weights dtype)
    "float32": (None, torch.float32),
    "bfloat16 autocast": (torch.bfloat16, torch.float32),
    "bfloat16 weights": (None, torch.bfloat16),
    "float16 autocast": (torch.float16, torch.float32),
    "float16 weights": (None, torch.float16),
}
VOCAB = 32


def dynamo_counts() -> dict:
    return {"graphs": counters["stats"]["unique_graphs"], "recompiles": sum(counters["recompiles"].values()),
            "breaks": sum(counters["graph_break"].values())}


def lm_run(log_dir, *, how="torch.compile(model)", dtype="float32", backend="inductor", steps=6, every=2, dropout=0.1,
           attach_after=0, **options):
    """AdamW steps of a two-block causal LM (``SdpaLM``, dropout on its residual branches)
    compiled ``how``, in ``dtype`` (:data:`DTYPES`), the Inspector watching when there is a
    ``log_dir`` (from step ``attach_after``: the steps before it run compiled, unwatched). The
    loss closure goes to ``replay_with`` for ``torch.compile(loss_fn)``, whose model is called
    from compiled code. Returns the losses (exact), the final state, Dynamo's counts and graph
    code, and layerwatch's warnings."""
    from torch._dynamo.testing import CompileCounterWithBackend

    dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    autocast, weights = DTYPES[dtype]
    torch.manual_seed(0)
    model = SdpaLM(VOCAB, dropout=dropout).to(weights)
    if how == "each block compiled":  # regional compilation, as torchtitan does
        for block in model.blocks:
            block.compile(backend=counter)
        call = model
    else:
        call = compile_as(model, how, counter)
    forward = torch.compile(lambda ids: call(ids), backend=counter) if how == "torch.compile(loss_fn)" else call
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)  # (an eps that float16 weights can hold)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (4, 12), generator=g) for _ in range(steps)]
    losses, inspector = [], None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for k, ids in enumerate(batches):
            if log_dir is not None and k == attach_after:
                inspector = Inspector(call, log_dir=log_dir, every_n_steps=every, optimizer=opt, **options).start()

            def loss_of(ids=ids):
                with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
                    logits = forward(ids[:, :-1])
                return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())

            losses.append(train_step(loss_of, opt, inspector, replay=how == "torch.compile(loss_fn)"))
        alerts = [] if inspector is None else [a.message for a in inspector.alerts]
        if inspector is not None:
            inspector.finish()
    assert hook_count(model, opt) == 0
    return {"losses": losses, "state": [t.clone() for t in model.state_dict().values()], "dynamo": dynamo_counts(),
            "graph_code": [graph.code for graph in counter.graphs], "said": layerwatch_messages(seen), "alerts": alerts}


def same_run(watched: dict, plain: dict, inputs_in_any_order: bool = False) -> None:
    """Bit for bit the run without layerwatch, with the very graphs it compiles (with
    ``inputs_in_any_order``, the graphs' inputs may come in another order: a model called from a
    compiled function is found at its first sample, when the function is compiled with that
    sample's hooks in place, which do nothing there but touch their arguments first)."""
    assert all(bool(torch.isfinite(t).all()) for t in plain["state"] if t.is_floating_point())  # a run that trains
    differing = [k for k, (a, b) in enumerate(zip(watched["state"], plain["state"])) if not torch.equal(a, b)]
    assert not differing, f"final weights differ: tensors {differing}"
    assert watched["losses"] == plain["losses"]
    assert watched["dynamo"] == plain["dynamo"]
    if inputs_in_any_order:  # the same lines, the signature's inputs as a set
        assert [_in_any_order(code) for code in watched["graph_code"]] == [_in_any_order(code) for code in plain["graph_code"]]
    else:
        assert watched["graph_code"] == plain["graph_code"]  # nothing of layerwatch's in them


def _in_any_order(code: str) -> tuple[list[str], set[str]]:
    lines = code.splitlines()
    signature = next(line for line in lines if line.startswith("def forward("))
    return sorted(line for line in lines if line is not signature), set(signature.split(", "))


BITWISE = [(how, "bfloat16 autocast") for how in HOWS] + [("torch.compile(model)", dtype) for dtype in DTYPES
                                                          if dtype != "bfloat16 autocast"]


@pytest.mark.parametrize("how, dtype", BITWISE, ids=[f"{how}, {dtype}" for how, dtype in BITWISE])
def test_a_compiled_run_is_the_run_without_layerwatch_bit_for_bit_with_the_same_graphs(tmp_path, events, how, dtype):
    plain, watched = lm_run(None, how=how, dtype=dtype), lm_run(tmp_path, how=how, dtype=dtype, output_head="head")
    same_run(watched, plain, inputs_in_any_order=how == "torch.compile(loss_fn)")
    assert plain["dynamo"]["graphs"] >= 1
    tab = tab_values(events(tmp_path))
    for key in ("activations_norm/blocks.0.attn.q", "activations_norm/head", "attention_logit_max/blocks.1.attn",
                "logsumexp_mean/head", "activations_kurtosis/blocks.0", "attention_head_entropy/blocks.0.attn#1",
                "activation_bytes/blocks.1", "fwd_ms/blocks.1.mlp"):
        assert sorted(tab[key]) == ([2, 4] if key.startswith("fwd_ms") else [0, 2, 4]), key  # (0: the layer table's)
    assert not [key for key in tab if key.startswith(("bwd_ms/", "saved_bytes/", "cuda_alloc_bytes/"))]


def test_a_model_compiled_before_layerwatch_attached_is_measured_and_left_as_it_was(tmp_path, events):
    plain = lm_run(None, backend="aot_eager", attach_after=2)
    watched = lm_run(tmp_path, backend="aot_eager", attach_after=2)
    same_run(watched, plain)
    assert [e.step for e in events(tmp_path).Scalars("activations_norm/blocks.1.mlp")] == [0, 2]  # its own steps


def test_what_a_compiled_step_measures_is_what_the_same_step_measures_eagerly(tmp_path, events, capsys):
    """Step 0 (same weights, same batch, and the re-run starts from the RNG state the step starts
    from: eager's dropout masks): every per-module value the compiled model's re-run gives is the
    eager step's; the backward's families alone are left out, and that is said once."""
    every_stat = ("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")
    lm_run(tmp_path / "eager", how="eager", backend="aot_eager", steps=1, stats=every_stat)
    capsys.readouterr()
    lm_run(tmp_path / "compiled", backend="aot_eager", steps=1, stats=every_stat)
    said = [line for line in capsys.readouterr().err.splitlines() if "forward-only re-run" in line]
    assert len(said) == 1 and "bwd_ms" in said[0], said
    eager, compiled = tab_values(events(tmp_path / "eager")), tab_values(events(tmp_path / "compiled"))
    backward = [key for key in eager if key.startswith(("bwd_ms/", "saved_bytes/"))]
    assert backward and not [key for key in compiled if key.startswith(("bwd_ms/", "saved_bytes/"))]
    measured = [key for key in eager if key not in backward and not key.startswith(("weights", "grads", "update", "adam"))]
    assert len(measured) > 100 and sorted(measured) == sorted(k for k in compiled if k in measured)
    for key in measured:
        if not key.startswith("fwd_ms/"):  # (a time: eager's, not the same run's)
            assert compiled[key][0] == pytest.approx(eager[key][0], rel=1e-5, abs=1e-6), key
    acc_eager, acc_compiled = events(tmp_path / "eager"), events(tmp_path / "compiled")
    for tag in [t for t in acc_eager.Tags()["histograms"] if t.startswith("activations/")]:
        a, b = acc_eager.Histograms(tag)[0].histogram_value, acc_compiled.Histograms(tag)[0].histogram_value
        assert (a.min, a.max, a.num) == pytest.approx((b.min, b.max, b.num), rel=1e-6), tag
        assert list(a.bucket) == pytest.approx(list(b.bucket)), tag


def test_the_re_run_keeps_no_output_of_its_forward(tmp_path):
    """Autograd off, nothing of the re-run outlives it: when the compiled forward starts, not one
    module output of the re-run is alive (the probes measure each as it comes)."""
    torch.manual_seed(0)
    model = SdpaLM(VOCAB, dropout=0.1)
    rerun_outputs: list[weakref.ref] = []
    alive_at_forward: list[int] = []

    def note(module, args, output):
        if not torch.is_grad_enabled() and isinstance(output, torch.Tensor):
            rerun_outputs.append(weakref.ref(output))

    handles = [m.register_forward_hook(note) for m in model.modules()]
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(compiled, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
        compiled.register_forward_pre_hook(lambda m, a: alive_at_forward.append(sum(r() is not None for r in rerun_outputs)))
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (4, 12))
            F.cross_entropy(compiled(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step()
            inspector.step()
    for handle in handles:
        handle.remove()
    assert len(rerun_outputs) > 20 and alive_at_forward == [0, 0]


@pytest.mark.parametrize("how", ["torch.compile(model)", "torch.compile(loss_fn)"])
def test_a_nan_made_inside_compiled_code_on_a_sampled_step_names_its_module(tmp_path, how):
    """The re-run sees it; given the batch (``replay_with``), the sentinel's finding replays the step
    (forward and backward), which names it too."""
    watched = spoiler_run(tmp_path, how=how, spoil_at=4, steps=5)
    named = "first offender: step 4, forward: 2 turned finite inputs into a non-finite output"
    assert [m for m in watched["alerts"] if m.startswith(named)], watched["alerts"]


def test_a_nan_made_in_the_compiled_backward_is_named_by_the_replay(tmp_path):
    """The re-run runs no backward; the sentinel's finding replays the step, forward and backward,
    eagerly, which names the module."""
    watched = spoiler_run(tmp_path, how="torch.compile(model)", spoil_at=4, steps=5, spoiler=GradientSpoiler(), replay=True)
    assert any(m.startswith("first offender: step 4, backward: 2 turned finite gradient with respect to its outputs")
               and "replayed from step 4" in m for m in watched["alerts"]), watched["alerts"]


def spoiler_run(log_dir, *, how, steps=8, every=2, spoil_at=None, spoiler=None, replay=None, backend="aot_eager"):
    """SGD steps of Linear, Tanh, a spoiler (NaN from ``spoil_at`` on), Linear, ReLU, Linear,
    compiled ``how``; with ``replay`` (and for ``torch.compile(loss_fn)``) the loss closure goes to
    ``replay_with``. Returns the losses and the alerts."""
    dynamo.reset()
    spoiler = spoiler if spoiler is not None else Spoiler()
    torch.manual_seed(0)
    model = Chain(nn.Linear(8, 16), nn.Tanh(), spoiler, nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    call = compile_as(model, how, backend)
    forward = torch.compile(lambda x: call(x), backend=backend) if how == "torch.compile(loss_fn)" else call
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(call, log_dir=log_dir, every_n_steps=every, optimizer=opt) as inspector:
            for k in range(steps):
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
                if k == spoil_at:
                    spoiler.scale.fill_(math.nan)

                def loss_of(x=x, y=y):
                    return F.mse_loss(forward(x), y)

                losses.append(train_step(loss_of, opt, inspector, replay=replay or how == "torch.compile(loss_fn)"))
    return {"losses": losses, "alerts": [a.message for a in inspector.alerts]}


class Checkpointed(nn.Module):
    """Two blocks under non-reentrant activation checkpointing, dropout inside."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.1)) for _ in range(2))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.out(x)


def small_run(make, log_dir, *, how="torch.compile(model)", backend="inductor", steps=4,
              batch=lambda g: torch.randn(8, 8, generator=g)):
    """SGD steps of ``make()`` compiled ``how`` (its wrapper, or a compiled loss function: the
    Inspector then watches the model itself, with no ``replay_with``), every second step sampled:
    losses (exact), final state (buffers too), Dynamo's counts and graph code."""
    from torch._dynamo.testing import CompileCounterWithBackend

    dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    torch.manual_seed(0)
    model = make()
    call = torch.compile(model, backend=counter) if how == "torch.compile(model)" else model
    loss_of = lambda x: call(x).float().pow(2).mean()  # noqa: E731
    loss_of = torch.compile(loss_of, backend=counter) if how == "torch.compile(loss_fn)" else loss_of
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    inspector = None if log_dir is None else Inspector(call, log_dir=log_dir, every_n_steps=2, optimizer=opt).start()
    for _ in range(steps):
        x = batch(g)
        losses.append(train_step(lambda: loss_of(x), opt, inspector))
    if inspector is not None:
        inspector.finish()
    assert hook_count(model, opt) == 0
    return {"losses": losses, "state": [t.clone() for t in model.state_dict().values()], "dynamo": dynamo_counts(),
            "graph_code": [graph.code for graph in counter.graphs]}


@pytest.mark.parametrize("make, batch", [(Checkpointed, lambda g: torch.randn(8, 8, generator=g)),
                                         (BatchNormNet, lambda g: torch.randn(4, 3, 8, 8, generator=g))],
                         ids=["activation checkpointing", "batchnorm and dropout"])
def test_checkpointing_and_batchnorm_inside_a_compiled_model_are_measured_and_left_as_they_were(tmp_path, events, make, batch):
    plain, watched = small_run(make, None, batch=batch), small_run(make, tmp_path, batch=batch)
    same_run(watched, plain)  # running statistics too
    tags = events(tmp_path).Tags()["scalars"]
    measured = [t for t in tags if t.startswith("activations_norm/")]
    assert len(measured) >= 4 and all([e.step for e in events(tmp_path).Scalars(t)] == [0, 2] for t in measured)


def test_a_re_run_that_fails_is_said_once_and_the_run_goes_on_as_it_was(tmp_path, events):
    """A forward that raises only when run again eagerly with autograd off (as an out-of-memory
    re-run would): said once, nothing measured per module, and the training as without it."""

    class FailsWhenRunAgain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
                raise torch.OutOfMemoryError("CPU: out of memory (a test's)")
            return x

    def make() -> nn.Module:
        return Chain(nn.Linear(8, 8), FailsWhenRunAgain(), nn.Linear(8, 4))

    plain = small_run(make, None, backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        watched = small_run(make, tmp_path, backend="aot_eager")
    same_run(watched, plain)
    said = [m for m in layerwatch_messages(seen) if "could not run a micro-batch of the sampled step again" in m]
    assert len(said) == 1 and "out of memory" in said[0]
    tags = events(tmp_path).Tags()["scalars"]
    assert [e.step for e in events(tmp_path).Scalars("weights_norm/0.weight")] == [0, 2]
    assert not [t for t in tags if t.startswith("activations_norm/")]


def test_a_compiled_function_called_without_its_batch_is_said_once_and_left_as_it_was(tmp_path, events):
    """``torch.compile(loss_fn)`` and no ``replay_with``: the first sample finds it, its hooks stay
    inert (the function was compiled with them), nothing compiles again, and what is missing is
    said once, with how to give it."""
    how = "torch.compile(loss_fn)"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        watched = small_run(MLP, tmp_path, how=how, backend="aot_eager", steps=6)
    plain = small_run(MLP, None, how=how, backend="aot_eager", steps=6)
    same_run(watched, plain, inputs_in_any_order=True)
    said = layerwatch_messages(seen)
    assert sum("runs inside compiled code" in m for m in said) == 1
    assert sum("no micro-batch of sampled step" in m and "replay_with" in m for m in said) == 1
    assert [e.step for e in events(tmp_path).Scalars("grads_norm/fc1.weight")] == [0, 2, 4]


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


# ---------------------------------------------------------------------- the layer table, from the re-run

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


def table_run(log_dir, make, batch, how, *, families=FAMILIES, steps=4):
    """SGD steps of ``make()`` compiled ``how`` ("a compiled part": the model compiled, in a
    ``Chain`` of its own) in a plain loop, every second step sampled. Returns the losses (exact),
    the final state, Dynamo's counts, the run's state just before the first sampled step and as
    its own forward starts, after the re-run that makes the table (but for ``model.compile()``,
    whose call is compiled, hooks and all), and layerwatch's warnings."""
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
    losses, around = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inspector = None if log_dir is None else Inspector(call, log_dir=log_dir, every_n_steps=2, optimizer=opt,
                                                           families=families).start()
        starts = None if how == "model.compile()" else call.register_forward_pre_hook(
            lambda module, args: around.append(run_state(model)) if len(around) == 1 else None)
        for k, x in enumerate(batches):
            around += [run_state(model)] if k == 0 else []
            loss = call(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(repr(loss.item()))
            if inspector is not None:
                inspector.step()
        if inspector is not None:
            inspector.finish()
        if starts is not None:
            starts.remove()
    assert hook_count(model, opt) == 0 and model.__dict__.get("_compiled_call_impl") is compiled_call
    return {
        "losses": losses, "state": [t.clone() for t in model.state_dict().values()], "around": around,
        "dynamo": {**dynamo_counts(), "frames": counter.frame_count}, "said": layerwatch_messages(seen),
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
def test_a_compiled_models_layer_table_comes_from_its_re_run(tmp_path, events, how, make, batch):
    """The first sampled step's re-run records the table: the eager model's (``summarize``), with
    the run as without it (bitwise losses, the very graphs, frames, graph breaks and recompiles)."""
    untabled_families = tuple(f for f in FAMILIES if f != "structure")
    plain = table_run(None, make, batch, how)
    untabled = table_run(tmp_path / "untabled", make, batch, how, families=untabled_families)
    watched = table_run(tmp_path / "watched", make, batch, how)
    assert watched["losses"] == untabled["losses"] == plain["losses"]
    assert all(torch.equal(a, b) for a, b in zip(watched["state"], plain["state"]))
    assert watched["dynamo"] == untabled["dynamo"] == plain["dynamo"]
    if how != "model.compile()":  # the generators, buffers, gradients and modes, as the re-run found them
        before, after = watched["around"]
        assert same_state(before, after)
    expected = eager_table(make, batch, how)
    assert logged_table(events(tmp_path / "watched")) == (0, expected.to_text())
    assert [e.value for e in events(tmp_path / "watched").Scalars("layerwatch/macs_per_step")] == [expected.total_macs]
    assert expected.total_macs > 0 and "layerwatch/structure/text_summary" not in events(tmp_path / "untabled").Tags()["tensors"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # Dynamo's note of the graph break at .item()
def test_a_forward_that_reads_a_value_on_the_host_gets_its_table_from_the_re_run(tmp_path, events):
    how = "torch.compile(model)"
    plain, watched = table_run(None, ReadsOnHost, vectors, how), table_run(tmp_path, ReadsOnHost, vectors, how)
    assert watched["losses"] == plain["losses"] and watched["dynamo"] == plain["dynamo"]
    assert logged_table(events(tmp_path)) == (0, eager_table(ReadsOnHost, vectors, how).to_text())


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
    for name in ("net", "net.0", "net.1", "net.2"):  # measured inside the compiled net too: on the re-run
        assert [e.step for e in acc.Scalars(f"activations_norm/{name}")] == [0, 2], name
    assert [e.step for e in acc.Scalars("fwd_ms/net.0")] == [2]  # (step 0 records the layer table)
    step, table = logged_table(acc)
    assert step == 0 and "    0 (Linear)" in table and "_orig_mod" not in table


def test_overhead_ms_counts_the_re_run(tmp_path, monkeypatch, events):
    """The re-run runs before the step's forward, outside every hook's clock: its time counts in the
    sampled step's ``overhead_ms`` (and so in the overhead budget's measure)."""
    from layerwatch.engine import rerun

    delay, original = 0.05, rerun.run_forward_again

    def slow(*args, **kwargs):
        time.sleep(delay)
        original(*args, **kwargs)

    monkeypatch.setattr(rerun, "run_forward_again", slow)
    spoiler_run(tmp_path, how="torch.compile(model)", steps=4, every=2)
    reported = [s.value for s in events(tmp_path).Scalars("layerwatch/overhead_ms")]
    assert len(reported) == 2 and all(ms >= 1e3 * delay for ms in reported), reported


class CallsCompiledHelpers(nn.Module):
    """An eager model that calls two compiled functions: attention (SDPA) and an activation."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.mlp, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 1)
        self.attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                    backend="aot_eager")
        self.act = torch.compile(lambda x: F.gelu(x) * 2, backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.attend(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.head(self.act(self.mlp(x)))


def test_compiled_functions_an_eager_model_calls_compile_as_without_layerwatch(tmp_path, events):
    """The model is eager and probed as it runs; the functions it calls compile on its first,
    sampled step, under the layer table's FLOP counter and the attention probe's stand-in for
    SDPA. Neither breaks their graphs (nor makes Dynamo skip them for good); the attention
    function, compiled with the stand-in in place, has one variant more for the unsampled
    steps (docs/probes.md, "What is left out")."""
    runs = {}
    for watched in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = CallsCompiledHelpers()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        inspector = Inspector(model, log_dir=tmp_path, optimizer=opt, every_n_steps=2).start() if watched else None
        losses = [train_step(lambda: model(torch.randn(2, 5, 16)).pow(2).mean(), opt, inspector) for _ in range(4)]
        if inspector is not None:
            inspector.finish()
        runs[watched] = losses, dynamo_counts(), dict(counters["frames"])
    (plain, plain_counts, plain_frames), (watched, counts, frames) = runs[False], runs[True]
    assert watched == plain
    assert plain_counts == {"graphs": 2, "recompiles": 0, "breaks": 0}, plain_counts
    assert counts == {"graphs": 3, "recompiles": 0, "breaks": 0}, counts
    assert frames["total"] == frames["ok"] and plain_frames["total"] == plain_frames["ok"], (frames, plain_frames)  # none skipped
    acc = events(tmp_path)
    assert [e.step for e in acc.Scalars("activations_norm/mlp")] == [0, 2]
    (table,) = acc.Tensors("layerwatch/structure/text_summary")
    assert "CallsCompiledHelpers" in table.tensor_proto.string_val[0].decode()
