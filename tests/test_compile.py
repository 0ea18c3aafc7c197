"""layerwatch stays out of compiled code: no hook body runs inside a Dynamo trace, and
attaching it adds no graph break, no graph and no recompile (counted by Dynamo itself).
The ``aot_eager`` backend needs no C++ compiler."""

import warnings

import pytest
import torch
from torch import nn

from layerwatch import Inspector
from models import MLP, hook_count, layerwatch_messages

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402


def run(log_dir, *, watch, compile_loss=False, compile_step=False, compile_model=False, steps=9):
    """Losses, Dynamo's counters and layerwatch's warnings of a small Adam run."""
    torch.manual_seed(0)
    dynamo.reset()
    counters.clear()
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    forward = torch.compile(model, backend="aot_eager") if compile_model else model

    def loss_fn(x, y):
        return nn.functional.mse_loss(forward(x), y)

    loss_of = torch.compile(loss_fn, backend="aot_eager") if compile_loss else loss_fn
    step = torch.compile(opt.step, backend="aot_eager") if compile_step else opt.step
    losses = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inspector = Inspector(forward, log_dir=log_dir, every_n_steps=3, optimizer=opt).start() if watch else None
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_of(x, y)
            loss.backward()
            step()
            losses.append(loss.item())
            if inspector is not None:
                inspector.step()
        if inspector is not None:
            inspector.finish()
    dynamo_counts = {
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters else 0,
    }
    assert hook_count(model, opt) == 0
    return losses, dynamo_counts, [str(w.message) for w in seen]


def test_a_compiled_loss_function_calling_the_model_runs_no_hook_and_compiles_the_same(tmp_path, events):
    plain, plain_counts, _ = run(tmp_path / "plain", watch=False, compile_loss=True)
    watched, counts, messages = run(tmp_path / "watched", watch=True, compile_loss=True)
    assert watched == plain  # bitwise
    assert counts == plain_counts and counts["graph_breaks"] == 0 and counts["unique_graphs"] == 1
    assert not [m for m in messages if "Dynamo" in m or "trace" in m.lower() and "layerwatch" not in m]
    said = layerwatch_messages(messages)
    assert len(said) == 1 and "runs inside compiled code" in said[0]
    acc = events(tmp_path / "watched")
    assert [e.step for e in acc.Scalars("grads_norm/fc1.weight")] == [0, 3, 6]  # parameter families go on
    assert [e.step for e in acc.Scalars("update_ratio/fc1.weight")] == [0, 3, 6]
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("fwd_ms/")]


def test_a_compiled_optimizer_step_is_not_traced_into(tmp_path, events):
    plain, plain_counts, _ = run(tmp_path / "plain", watch=False, compile_step=True)
    watched, counts, messages = run(tmp_path / "watched", watch=True, compile_step=True)
    assert watched == plain
    assert counts == plain_counts and counts["unique_graphs"] == 1
    assert not [m for m in messages if not m.startswith("layerwatch")]  # Dynamo warns of nothing
    said = layerwatch_messages(messages)
    assert len(said) == 1 and "step hooks did not run" in said[0]
    acc = events(tmp_path / "watched")
    assert [e.step for e in acc.Scalars("grads_norm/fc1.weight")] == [0, 3, 6]  # read in step() instead
    assert [e.step for e in acc.Scalars("fwd_ms/fc1")] == [3, 6]  # probes are eager here (step 0: layer table)


def test_a_compiled_model_keeps_the_parameter_families_without_a_recompile(tmp_path, events):
    plain, plain_counts, _ = run(tmp_path / "plain", watch=False, compile_model=True)
    watched, counts, messages = run(tmp_path / "watched", watch=True, compile_model=True)
    assert watched == plain
    assert counts == plain_counts
    said = layerwatch_messages(messages)
    assert len(said) == 1 and "torch.compile'd" in said[0]
    acc = events(tmp_path / "watched")
    assert [e.step for e in acc.Scalars("weights_norm/fc1.weight")] == [0, 3, 6]
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("fwd_ms/")]


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
    tags = events(tmp_path / "layerwatch").Tags()["scalars"]
    assert {"weights_norm/net.0.weight", "grads_norm/net.2.bias", "update_ratio/net.0.weight"} <= set(tags)
    assert not [t for t in tags if "_orig_mod" in t]
