"""Sharded and parallel training on two CPU ranks (gloo): FSDP2 in every wrapping, tensor
parallel, FSDP1 and DDP, plain and under Lightning, at the defaults. Each case checks that
training is unchanged (bitwise losses), that rank 0 alone writes, that statistics of sharded
tensors are those of the whole tensors, and that nothing hangs: every case runs through
:func:`ranks.run_ranks` (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and deadlines)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from layerwatch import Inspector, summarize
from models import MLP, hook_count, scripted_ideal, tab_values
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

STEPS = 4
EVERY = 2  # steps 0 and 2 are sampled
POISON_STEP = 2


class PoisonGrad(torch.autograd.Function):
    """``x * gain``; when ``poison``, the gradient of ``gain`` is NaN and that of ``x`` is not: a
    fault only the model's own end-of-backward check of its parameters' gradients can see."""

    @staticmethod
    def forward(ctx, x, gain, poison):
        ctx.save_for_backward(x, gain)
        ctx.poison = poison
        return x * gain

    @staticmethod
    def backward(ctx, grad):
        x, gain = ctx.saved_tensors
        grad_gain = (grad * x).sum(0)
        if ctx.poison:
            grad_gain = torch.full_like(grad_gain, float("nan"))
        return grad * gain, grad_gain, None


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Stack(nn.Module):
    """Linear, two residual blocks, Linear, and a gain of the model's own (its root unit's)."""

    def __init__(self, d: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.out = nn.Linear(d, 3)
        self.gain = nn.Parameter(torch.ones(3))
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return PoisonGrad.apply(self.out(x), self.gain, self.poison)


STACK_MODULES = ["(root)", "inp", "out"] + [f"blocks.{b}{m}" for b in (0, 1) for m in ("", ".norm", ".fc1", ".act", ".fc2")]


def shard_stack(model: Stack, wrapping: str, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    if wrapping.endswith("checkpointed"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if wrapping.startswith("per_layer"):
        for module in list(model.modules()):
            if isinstance(module, (nn.Linear, nn.LayerNorm)):
                fully_shard(module, mesh=mesh)
    if wrapping.startswith(("per_layer", "per_block")):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def losses_equal(a: list[float], b: list[float]) -> bool:
    return np.array_equal(np.array(a), np.array(b), equal_nan=True)


def record(out: str, name: str, value) -> None:
    Path(out, name).write_text(json.dumps(value))


def train_both_ways(build: Callable[[], nn.Module], loss_of: Callable[[nn.Module, int], torch.Tensor], out: str,
                    observe: Optional[Callable[[nn.Module, int], Any]] = None, replay: bool = False,
                    **options: Any) -> dict[int, Any]:
    """Train ``build()`` twice from one seed, without and with an Inspector (``options``, writing
    to ``out/run``), ``STEPS`` SGD steps of ``loss_of(model, step)`` (given to ``replay_with``
    first with ``replay``). Asserts that the losses are bitwise equal and that no hook of
    layerwatch's stays; returns what ``observe(model, step)`` saw after each step of the
    inspected run."""
    losses, seen = {}, {}
    for inspected in (False, True):
        torch.manual_seed(0)
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        hooks = hook_count(model, opt)  # the parallel styles' and FSDP's own
        inspector = Inspector(model, log_dir=f"{out}/run", optimizer=opt, **options).start() if inspected else None
        losses[inspected] = []
        for step in range(STEPS):
            if inspector is not None and replay:
                inspector.replay_with(lambda step=step: loss_of(model, step))
            loss = loss_of(model, step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if inspector is not None:
                inspector.step()
                if observe is not None:
                    seen[step] = observe(model, step)
            losses[inspected].append(loss.item())
        if inspector is not None:
            inspector.finish()
            assert hook_count(model, opt) == hooks
    assert losses_equal(losses[True], losses[False]), losses
    return seen


def fsdp2_worker(rank: int, world: int, out: str, wrapping: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    def build() -> nn.Module:
        model = Stack()
        shard_stack(model, wrapping, mesh)
        return model

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own data
        model.poison = step == POISON_STEP
        return model(torch.randn(4, 6)).pow(2).mean()

    def observe(model: nn.Module, step: int) -> dict:  # the whole tensors: the step's gradients, the weights after it
        return {"grads": {n: p.grad.full_tensor().double().norm().item() for n, p in model.named_parameters()},
                "weights": {n: p.full_tensor().double().norm().item() for n, p in model.named_parameters()}}

    reference = train_both_ways(build, loss_of, out, observe, every_n_steps=EVERY)
    if rank == 0:
        record(out, "reference.json", reference)


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def check_whole_tensor_norms(acc, reference: dict, steps=(0,)) -> None:
    for step in steps:
        for family in ("grads", "weights"):
            for name, norm in reference[str(step)][family].items():
                if np.isfinite(norm):
                    got = {e.step: e.value for e in acc.Scalars(f"{family}_norm/{clean(name)}")}[step]
                    assert got == pytest.approx(norm, rel=1e-5), (step, family, name)


def one_writer(run: Path) -> None:
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # rank 0's


@pytest.mark.parametrize("wrapping", ["root", "per_block", "per_layer", "per_block_checkpointed"])
def test_fsdp2_every_wrapping_at_the_defaults(tmp_path, events, wrapping):
    run_ranks(fsdp2_worker, str(tmp_path), wrapping, tmp=tmp_path)
    one_writer(tmp_path / "run")
    acc = events(tmp_path / "run")
    reference = json.loads((tmp_path / "reference.json").read_text())
    check_whole_tensor_norms(acc, reference, steps=(0, POISON_STEP))
    scalars = set(acc.Tags()["scalars"])
    assert {f"fwd_ms/{m}" for m in STACK_MODULES} <= scalars
    assert {f"activations/{m}" for m in STACK_MODULES} <= set(acc.Tags()["histograms"])
    assert not [t for t in scalars | set(acc.Tags()["histograms"]) if "_wrapped_module" in t]
    # The model's own end-of-backward check read the gradients FSDP had put back: gain's is NaN.
    tab = tab_values(acc)
    assert tab["nonfinite/(root)"] == {0: 0.0, POISON_STEP: 1.0}
    assert [tab[f"nonfinite/{m}"][POISON_STEP] for m in STACK_MODULES[1:]] == [0.0] * (len(STACK_MODULES) - 1)
    (text,) = acc.Tensors("layerwatch/first_offender/text_summary")
    assert text.tensor_proto.string_val[0].decode().startswith(f"step {POISON_STEP}, backward: (root) turned finite")


STATS = ("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")


def every_statistic_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    before: dict[str, np.ndarray] = {}

    def build() -> nn.Module:
        model = MLP(d_in=8, hidden=10, d_out=3)  # 10 rows over 2 ranks, 3 biases: uneven shards
        for layer in (model.fc1, model.fc2):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        before.update({n: p.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()})
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own data
        return model(torch.randn(4, 8)).pow(2).mean()

    def observe(model: nn.Module, step: int) -> None:  # the whole tensors: the step's gradients, the weights before and after it
        whole = {f"grads/{n}": p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
        whole |= {f"weights/{n}": p.full_tensor().detach().numpy() for n, p in model.named_parameters()}
        if rank == 0:
            np.savez(f"{out}/step{step}.npz", **whole, **{f"before/{n}": a for n, a in before.items()})

    train_both_ways(build, loss_of, out, observe, every_n_steps=1, stats=STATS)


def test_fsdp2_per_layer_every_statistic_and_histogram_is_the_whole_tensors(tmp_path, events):
    run_ranks(every_statistic_worker, str(tmp_path), tmp=tmp_path)
    acc = events(tmp_path / "run")
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    activations = [f"activations/{m}" for m in ("(root)", "fc1", "act", "fc2")]  # rank 0's own batch, as under DDP
    assert sorted(acc.Tags()["histograms"]) == sorted([f"{f}/{n}" for f in ("weights", "grads") for n in names] + activations)
    tab = tab_values(acc)
    for step in range(STEPS):
        reference = np.load(tmp_path / f"step{step}.npz")
        for family in ("weights", "grads"):
            for name in names:
                a = reference[f"{family}/{name}"].ravel().astype(np.float64)
                expected = {"mean": a.mean(), "std": a.std(), "min": a.min(), "max": a.max(),
                            "norm": np.linalg.norm(a), "zero_frac": (a == 0).mean()}
                for stat, value in expected.items():
                    got = {e.step: e.value for e in acc.Scalars(f"{family}_{stat}/{name}")}[step]
                    assert got == pytest.approx(value, rel=1e-4, abs=1e-6), (step, family, stat, name)
                assert tab[f"{family}_nonfinite/{name}"][step] == 0.0  # a card only once a layer has a NaN/Inf
                hist = {e.step: e.histogram_value for e in acc.Histograms(f"{family}/{name}")}[step]
                assert hist.num == a.size and sum(hist.bucket) == a.size
                counts, _ = np.histogram(a, [hist.min] + list(hist.bucket_limit))
                assert np.abs(counts - np.array(hist.bucket)).sum() <= 2  # a value on an edge may move
            for name in names:
                delta = reference[f"weights/{name}"] - reference[f"before/{name}"]
                ratio = np.linalg.norm(delta) / np.linalg.norm(reference[f"weights/{name}"])  # w after the step
                assert {e.step: e.value for e in acc.Scalars(f"update_ratio/{name}")}[step] == pytest.approx(ratio, rel=1e-4)
        grads = [reference[f"grads/{n}"].astype(np.float64) for n in names]
        grad_norm = {e.step: e.value for e in acc.Scalars("layerwatch/grad_norm")}[step]
        assert grad_norm == pytest.approx(np.sqrt(sum((g**2).sum() for g in grads)), rel=1e-5)


# ---------------------------------------------------------------------- a Mixture-of-Experts' experts, sharded

EXPERTS = 3  # over two ranks along dim 0: rank 0 holds experts 0 and 1, rank 1 expert 2


def expert_rows_worker(rank: int, world: int, out: str) -> None:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    before: dict[str, np.ndarray] = {}

    def build() -> nn.Module:
        config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            num_local_experts=EXPERTS, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert model.model.layers[0].mlp.experts.down_proj.to_local().shape[0] == (2, 1)[rank]  # whole experts each
        return model

    def experts(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if ".experts." in n]

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        before.update({n: p.full_tensor().detach().numpy().copy() for n, p in experts(model)})
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own data
        tokens = torch.randint(0, 64, (2, 8))
        return model(input_ids=tokens, labels=tokens).loss

    def observe(model: nn.Module, step: int) -> None:  # the whole tensors: the step's gradients, the weights before and after it
        whole = {f"grads/{n}": p.grad.full_tensor().numpy() for n, p in experts(model)}
        whole |= {f"weights/{n}": p.full_tensor().detach().numpy() for n, p in experts(model)}
        if rank == 0:
            np.savez(f"{out}/step{step}.npz", **whole, **{f"before/{n}": a for n, a in before.items()})

    train_both_ways(build, loss_of, out, observe, every_n_steps=2)


def test_fsdp2_experts_sharded_along_their_dim_have_each_expert_s_rows(tmp_path, events):
    run_ranks(expert_rows_worker, str(tmp_path), tmp=tmp_path)
    tab = tab_values(events(tmp_path / "run"))
    for step in (0, 2):
        reference = np.load(tmp_path / f"step{step}.npz")
        names = [key[len("weights/"):] for key in reference.files if key.startswith("weights/")]
        assert len(names) == 4
        for name in names:
            w, g = reference[f"weights/{name}"].astype(np.float64), reference[f"grads/{name}"].astype(np.float64)
            delta = w - reference[f"before/{name}"]
            for e in range(EXPERTS):
                row = f"{name}[{e}]"
                assert tab[f"weights_norm/{row}"][step] == pytest.approx(np.linalg.norm(w[e]), rel=1e-5), (step, row)
                assert tab[f"grads_norm/{row}"][step] == pytest.approx(np.linalg.norm(g[e]), rel=1e-5), (step, row)
                ratio = np.linalg.norm(delta[e]) / np.linalg.norm(w[e])
                assert tab[f"update_ratio/{row}"][step] == pytest.approx(ratio, rel=1e-4), (step, row)
            squares = sum(tab[f"grads_norm/{name}[{e}]"][step] ** 2 for e in range(EXPERTS))
            assert squares == pytest.approx(tab[f"grads_norm/{name}"][step] ** 2, rel=1e-5)


# ---------------------------------------------------------------------- Lightning ModelParallelStrategy


def lightning_worker(rank: int, world: int, out: str, parallel: str) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from layerwatch import InspectCallback
    from models import LitParallel

    losses = {}
    for inspected in (False, True):
        torch.manual_seed(0)
        module = LitParallel(parallel)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=ModelParallelStrategy(data_parallel_size=world if parallel == "fsdp2" else 1,
                                                                             tensor_parallel_size=1 if parallel == "fsdp2" else world),
            max_steps=STEPS, logger=L.loggers.TensorBoardLogger(out, name="run", version=int(inspected)),
            callbacks=[InspectCallback(every_n_steps=EVERY)] if inspected else [], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        )
        trainer.fit(module)
        losses[inspected] = module.losses
    assert losses_equal(losses[True], losses[False]), losses


@pytest.mark.parametrize("parallel", ["fsdp2", "tensor"])
def test_lightning_model_parallel_strategy(tmp_path, events, parallel):
    pytest.importorskip("lightning")
    run_ranks(lightning_worker, str(tmp_path), parallel, tmp=tmp_path)
    run = tmp_path / "run" / "version_1"
    one_writer(run)
    acc = events(run)
    modules = ["net", "net.fc1", "net.act", "net.fc2"]  # training_step calls net: the root module runs no forward
    assert {f"fwd_ms/{m}" for m in modules} <= set(acc.Tags()["scalars"])
    assert {f"activations/{m}" for m in modules} <= set(acc.Tags()["histograms"])
    assert [e.step for e in acc.Scalars("weights_norm/net.fc1.weight")] == [0, 2]


# ---------------------------------------------------------------------- tensor parallel


def poison_rank_one(rank: int, step: list[int]):
    """A forward hook that, on rank 1 only, puts a NaN into its shard of fc1's output at POISON_STEP."""

    def hook(module, args, output):
        if rank == 1 and step[0] == POISON_STEP:
            poisoned = output.clone()
            poisoned[0, 0] = float("nan")
            return poisoned

    return hook


def tensor_parallel_worker(rank: int, world: int, out: str) -> None:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    step_now, whole = [0], {}

    def build() -> nn.Module:
        model = MLP(d_in=8, hidden=16, d_out=8)
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        model.fc1.register_forward_hook(poison_rank_one(rank, step_now))
        return model

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        step_now[0] = step
        torch.manual_seed(100 + step)  # the same input on both ranks: tensor parallel
        x = torch.randn(4, 8)
        whole[step] = F.linear(x, model.fc1.weight.full_tensor(), model.fc1.bias.full_tensor()).detach()
        return model(x).pow(2).mean()

    def observe(model: nn.Module, step: int) -> dict:
        return {"fc1": whole[step].flatten().tolist(), "act": whole[step].relu().flatten().tolist(),
                "weights": {n: p.full_tensor().double().norm().item() for n, p in model.named_parameters()}}

    reference = train_both_ways(build, loss_of, out, observe, every_n_steps=1)
    if rank == 0:
        record(out, "reference.json", reference)


def test_tensor_parallel_activations_are_those_of_the_whole_output(tmp_path, events):
    run_ranks(tensor_parallel_worker, str(tmp_path), tmp=tmp_path)
    one_writer(tmp_path / "run")
    acc = events(tmp_path / "run")
    reference = json.loads((tmp_path / "reference.json").read_text())
    for step in (0, 1):
        for module in ("fc1", "act"):
            whole = np.array(reference[str(step)][module], dtype=np.float64)
            assert whole.size == 4 * 16  # both ranks' columns
            norm = {e.step: e.value for e in acc.Scalars(f"activations_norm/{module}")}[step]
            assert norm == pytest.approx(np.linalg.norm(whole), rel=1e-5), (step, module)
            hist = {e.step: e.histogram_value for e in acc.Histograms(f"activations/{module}")}[step]
            assert hist.num == whole.size and sum(hist.bucket) == pytest.approx(whole.size)
            assert (hist.min, hist.max) == (pytest.approx(whole.min(), abs=1e-6), pytest.approx(whole.max(), abs=1e-6))
            assert hist.sum == pytest.approx(whole.sum(), rel=1e-5, abs=1e-6)
            assert hist.sum_squares == pytest.approx((whole**2).sum(), rel=1e-5)
        for name, norm in reference[str(step)]["weights"].items():
            assert {e.step: e.value for e in acc.Scalars(f"weights_norm/{name}")}[step] == pytest.approx(norm, rel=1e-5)
    assert {f"fwd_ms/{m}" for m in ("(root)", "fc1", "act", "fc2")} <= set(acc.Tags()["scalars"])
    # Rank 1's shard of fc1's output held the NaN; rank 0's did not, yet fc1 is named, not fc2.
    (text,) = acc.Tensors("layerwatch/first_offender/text_summary")
    assert text.tensor_proto.string_val[0].decode() == (
        f"step {POISON_STEP}, forward: fc1 turned finite inputs into a non-finite output"
    )
    tab = tab_values(acc)
    assert [tab[f"nonfinite/{m}"][POISON_STEP] for m in ("fc1", "act", "fc2")] == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------- FSDP1


def fsdp1_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 3))


def check_unsharded_table(acc) -> None:
    """The layer table counts whole parameters, where rank 0 holds pieces of them (or, with
    ``use_orig_params=False``, only flat parameters): it is the unsharded model's."""
    unsharded = summarize(fsdp1_model(), torch.randn(4, 8))
    (table,) = acc.Tensors("layerwatch/structure/text_summary")
    assert "\n".join(line[4:] for line in table.tensor_proto.string_val[0].decode().splitlines()) == unsharded.to_text()
    assert [(e.step, e.value) for e in acc.Scalars("layerwatch/params_total")] == [(0, unsharded.total_params)]


def fsdp1_worker(rank: int, world: int, out: str, orig: bool) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def build() -> nn.Module:
        return FSDP(fsdp1_model(), use_orig_params=orig, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                    device_id=torch.device("cpu"))

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        torch.manual_seed(100 + 10 * step + rank)
        return model(torch.randn(4, 8)).pow(2).mean()

    def observe(model: nn.Module, step: int) -> Optional[dict]:
        if not orig:
            return None
        with FSDP.summon_full_params(model):
            return {"weights": {FSDP_clean(n): p.detach().double().norm().item() for n, p in model.named_parameters()}}

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        reference = train_both_ways(build, loss_of, out, observe, every_n_steps=EVERY)
    if rank == 0:
        record(out, "warnings.json", [str(w.message) for w in seen if "layerwatch" in str(w.message)])
        record(out, "reference.json", reference)


def FSDP_clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def test_fsdp1_use_orig_params_exact_statistics_under_clean_names(tmp_path, events):
    run_ranks(fsdp1_worker, str(tmp_path), True, tmp=tmp_path)
    one_writer(tmp_path / "run")
    acc = events(tmp_path / "run")
    reference = json.loads((tmp_path / "reference.json").read_text())
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sorted(reference["0"]["weights"]) == sorted(names)
    for step in (0, 2):
        for name in names:  # rank 0 holds only part of each (the biases: none), yet the whole tensor's norm
            got = {e.step: e.value for e in acc.Scalars(f"weights_norm/{name}")}[step]
            assert got == pytest.approx(reference[str(step)]["weights"][name], rel=1e-5), (step, name)
            hist = {e.step: e.histogram_value for e in acc.Histograms(f"weights/{name}")}[step]
            assert hist.num == {"0.weight": 96, "0.bias": 12, "2.weight": 36, "2.bias": 3}[name]
        assert {f"grads_norm/{n}" for n in names} | {f"update_ratio/{n}" for n in names} <= set(acc.Tags()["scalars"])
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["histograms"])
    assert {"activations/(root)", "activations/0", "activations/1", "activations/2"} <= tags
    assert not [t for t in tags if "_fsdp_wrapped_module" in t or "flat_param" in t]
    assert not [w for w in json.loads((tmp_path / "warnings.json").read_text()) if "use_orig_params" in w]
    check_unsharded_table(acc)


def test_fsdp1_flat_parameters_are_said_once_and_the_modules_are_still_probed(tmp_path, events):
    run_ranks(fsdp1_worker, str(tmp_path), False, tmp=tmp_path)
    acc = events(tmp_path / "run")
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["histograms"])
    assert {"activations/(root)", "activations/0", "activations/2", "fwd_ms/0"} <= tags
    assert not [t for t in tags if t.startswith(("weights", "grads", "update_ratio")) or "flat_param" in t]
    said = [w for w in json.loads((tmp_path / "warnings.json").read_text()) if "use_orig_params=True" in w]
    assert len(said) == 1 and "FSDP wraps 0, 2 with use_orig_params=False" in said[0]
    check_unsharded_table(acc)


def fsdp1_outside_worker(rank: int, world: int, out: str) -> None:
    """The model is wrapped in one FSDP1 unit from outside, as Lightning's ``strategy="fsdp"``
    wraps the LightningModule; the engine watches the module inside, told of the wrapper."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from layerwatch.engine.engine import Engine
    from layerwatch.options import validate_options

    torch.manual_seed(0)
    inner = fsdp1_model()
    wrapper = FSDP(inner, use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.05)
    engine = Engine(inner, validate_options(every_n_steps=EVERY), log_dir=f"{out}/run").start(within=wrapper)
    reference = {}
    for step in range(STEPS):
        engine.begin_step(step)
        torch.manual_seed(100 + 10 * step + rank)
        loss = wrapper(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        engine.before_optimizer_step(opt)
        opt.step()
        engine.after_optimizer_step(opt)
        engine.end_step()
        with FSDP.summon_full_params(wrapper):
            reference[step] = {n: p.detach().double().norm().item() for n, p in inner.named_parameters()}
    engine.finish()
    if rank == 0:
        record(out, "reference.json", reference)


def test_fsdp1_wrapped_from_outside_the_watched_module(tmp_path, events):
    run_ranks(fsdp1_outside_worker, str(tmp_path), tmp=tmp_path)
    acc = events(tmp_path / "run")
    reference = json.loads((tmp_path / "reference.json").read_text())
    for step in (0, 2):
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):  # rank 0 holds 92 of the 147 values
            got = {e.step: e.value for e in acc.Scalars(f"weights_norm/{name}")}[step]
            assert got == pytest.approx(reference[str(step)][name], rel=1e-5), (step, name)
    check_unsharded_table(acc)


# ---------------------------------------------------------------------- DDP


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        x = torch.relu(self.trunk(x))
        return self.head(self.branch(x) if use_branch else x)


def ddp_worker(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        torch.manual_seed(100 + 10 * step + rank)
        return model(torch.randn(4, 8), use_branch=rank == 1).pow(2).mean()  # the branch is unused on rank 0

    train_both_ways(lambda: DistributedDataParallel(Branchy(), find_unused_parameters=True), loss_of, out, every_n_steps=EVERY)


def test_ddp_with_a_branch_unused_on_one_rank(tmp_path, events):
    run_ranks(ddp_worker, str(tmp_path), tmp=tmp_path, debug="INFO")  # DETAIL crashes DDP's constructor (see run_ranks)
    one_writer(tmp_path / "run")
    acc = events(tmp_path / "run")
    assert [e.step for e in acc.Scalars("grads_norm/module.branch.weight")] == [0, 2]  # synchronized: rank 1 used it
    assert "fwd_ms/module.trunk" in acc.Tags()["scalars"]


# ---------------------------------------------------------------------- the reductions themselves


def precision_worker(rank: int, world: int, out: str) -> None:
    import layerwatch.stats as stats

    whole = 1.0 + 1e-4 * torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))  # float32, mean 1, std 1e-4
    shard = whole.chunk(world)[rank]
    row = stats.reduce_sharded([shard], dist.group.WORLD, 32, centered=True)[0].numpy()
    if rank == 0:
        record(out, "row.json", {"std": float(np.sqrt(row[stats.CENTERED_SUMSQ] / row[stats.COUNT])),
                                 "reference": whole.double().std(correction=0).item(), "count": float(row[stats.COUNT])})


def test_the_std_of_a_sharded_tensor_keeps_its_digits(tmp_path):
    """SUMSQ - SUM**2 / COUNT in float32 sums reads this std as 0; the shards' centred sums,
    combined, read it to 1e-4."""
    run_ranks(precision_worker, str(tmp_path), tmp=tmp_path)
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["count"] == 1 << 20
    assert row["std"] == pytest.approx(row["reference"], rel=1e-4)


# ---------------------------------------------------------------------- what could set the ranks apart


def ranks_apart_worker(rank: int, world: int, out: str, case: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import layerwatch.measure.params as params
    import layerwatch.probes.evidence as evidence
    import layerwatch.probes.outputs as outputs
    import layerwatch.stats as stats

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    fsdp = case in ("schedule", "reduction", "snapshot")
    if fsdp:
        model = Stack()
        shard_stack(model, "per_layer", mesh)
    else:
        model = MLP(d_in=8, hidden=16, d_out=8)
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    options = {"every_n_steps": 1}
    if case == "schedule":  # each rank a schedule of its own: rank 0's is followed
        options = {"schedule": lambda step: step % 2 == rank}
    if case == "sentinel":
        options = {"schedule": [0]}
    if rank == 0 and case == "probe":
        def failing(t):
            raise RuntimeError("a probe that fails on rank 0 alone")
        evidence.nonfinite_sum = failing  # where the runtime probe's flags read it
    if rank == 0 and case == "reduction":
        def failing_statistics(*args):
            raise RuntimeError("a reduction that fails on rank 0 alone")
        stats.shard_statistics = stats.sharded.shard_statistics = failing_statistics  # where each caller reads it
    if rank == 0 and case == "result":  # at step 1, after the collectives of the probes' result
        rows, calls = outputs.Outputs.rows, [0]

        def failing_rows(self, *args):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("a probe's result that fails on rank 0 alone")
            return rows(self, *args)
        outputs.Outputs.rows = failing_rows
    if rank == 0 and case == "snapshot":
        def failing_copies(self, tensors, slot):
            raise MemoryError("a snapshot that fails on rank 0 alone")
        params.ParameterFamilies._copies = failing_copies
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=f"{out}/run", optimizer=opt, **options) as inspector:
            for step in range(5):
                torch.manual_seed(100 + step)
                x = torch.randn(4, 6 if fsdp else 8)
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                if case == "sentinel" and rank == 1 and step == 1:  # a NaN in rank 1's shard of a gradient alone
                    with torch.no_grad():
                        model.fc2.weight.grad._local_tensor[0, 0] = float("nan")
                opt.step()
                inspector.step()
    if rank == 0:
        record(out, "warnings.json", [str(w.message) for w in seen if str(w.message).startswith("layerwatch")])


@pytest.mark.parametrize("case", ["probe", "result", "reduction", "snapshot", "schedule", "sentinel"])
def test_what_sets_one_rank_apart_leaves_no_rank_waiting(tmp_path, events, case):
    run_ranks(ranks_apart_worker, str(tmp_path), case, tmp=tmp_path)
    acc = events(tmp_path / "run")
    said = json.loads((tmp_path / "warnings.json").read_text())
    scalars = set(acc.Tags()["scalars"])
    if case == "probe":  # off on every rank alike; the parameters go on
        assert any("a runtime probe failed" in w and "fails on rank 0 alone" in w for w in said)
        assert not [t for t in scalars if t.startswith("fwd_ms/")]
        assert [e.step for e in acc.Scalars("weights_norm/fc1.weight")] == [0, 1, 2, 3, 4]
    if case == "reduction":  # left out of the step on every rank; the rest goes on
        assert any("could not measure its shards" in w for w in said)
        assert not [t for t in scalars if t.startswith("weights_norm/")]  # every parameter is sharded
        assert [e.step for e in acc.Scalars("fwd_ms/blocks.0.fc1")] == [1, 2, 3, 4]  # 0 recorded the layer table
    if case == "result":  # rank 0 turned its probes off at step 1; at step 2 every rank did
        assert any("a runtime probe failed" in w and "fails on rank 0 alone" in w for w in said)
        assert [e.step for e in acc.Scalars("activations_norm/fc1")] == [0]
        assert [e.step for e in acc.Scalars("weights_norm/fc1.weight")] == [0, 1, 2, 3, 4]
    if case == "snapshot":  # every rank reduced the update norms; they read as failed and are left out
        assert any("could not snapshot weights" in w for w in said) and any("update ratios are left out" in w for w in said)
        assert not [t for t in scalars if t.startswith("update_ratio/")]
        assert [e.step for e in acc.Scalars("weights_norm/inp.weight")] == [0, 1, 2, 3, 4]
    if case == "schedule":
        assert [e.step for e in acc.Scalars("weights_norm/inp.weight")] == [0, 2, 4]
    if case == "sentinel":
        assert [(e.step, e.value) for e in acc.Scalars("layerwatch/first_nonfinite_step")] == [(1, 1.0)]
        assert any("NaN/Inf gradients at step 1" in w and "held by another rank" in w and "step 3 is sampled" in w for w in said)
        assert [e.step for e in acc.Scalars("fwd_ms/fc1")] == [3]  # every rank armed it


def compiled_both_ways(build: Callable[[], nn.Module], loss_of: Callable[[nn.Module, int], torch.Tensor], out: str,
                       observe: Callable[[nn.Module, int], Any], **options: Any) -> dict[int, Any]:
    """:func:`train_both_ways` of a compiled model (``build()`` compiles it), asserting also that
    Dynamo compiled the same graphs, breaks and recompiles with the Inspector as without it."""
    from torch._dynamo.utils import counters

    counts = []

    def built() -> nn.Module:
        if counts:  # the run before is over: its counts
            counts[-1] = dynamo_counts()
        torch._dynamo.reset()
        counters.clear()
        counts.append(None)
        return build()

    def dynamo_counts() -> tuple[int, int, int]:
        return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
                sum(counters["recompiles"].values()))

    seen = train_both_ways(built, loss_of, out, observe, **options)
    counts[-1] = dynamo_counts()
    assert len(counts) == 2 and counts[0] == counts[1] and counts[0][0] >= 1, counts  # without, with
    return seen


class Dropped(Stack):
    """:class:`Stack` with dropout after its input layer: the re-run must leave the RNG as it was."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(nn.functional.dropout(x, 0.2, self.training))


def compiled_worker(rank: int, world: int, out: str, setup: str) -> None:
    """A compiled model (``aot_eager``) under DDP (``torch.compile(DDP(model))``), FSDP2 per layer
    or tensor parallel, every second step sampled: every rank re-runs the sampled step's batch at
    the same point (FSDP's all-gathers, tensor parallel's reductions: the same collectives in the
    same order), with bitwise losses, the same graphs, and the whole tensors' statistics."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    whole: dict[int, Any] = {}

    def build() -> nn.Module:
        if setup == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return torch.compile(DistributedDataParallel(Dropped()), backend="aot_eager")
        if setup == "fsdp2":
            model = Dropped()
            shard_stack(model, "per_layer", mesh)
            return torch.compile(model, backend="aot_eager")
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = MLP(d_in=8, hidden=16, d_out=8)
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        return torch.compile(model, backend="aot_eager")

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        if setup == "tensor parallel":
            torch.manual_seed(100 + step)  # the same input on both ranks
            x = torch.randn(4, 8)
            fc1 = model._orig_mod.fc1
            whole[step] = F.linear(x, fc1.weight.full_tensor(), fc1.bias.full_tensor()).detach()
            return model(x).pow(2).mean()
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own data
        return model(torch.randn(4, 6)).pow(2).mean()

    def observe(model: nn.Module, step: int) -> dict:
        inner = model._orig_mod
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).double().norm().item()
                   for n, p in inner.named_parameters()}  # every rank: full_tensor is collective
        return {"weights": weights, "fc1": whole[step].norm().item() if step in whole else None}

    reference = compiled_both_ways(build, loss_of, out, observe, every_n_steps=EVERY)
    if rank == 0:
        record(out, "reference.json", reference)


@pytest.mark.parametrize("setup", ["ddp", "fsdp2", "tensor parallel"])
def test_a_compiled_model_is_measured_on_every_ranks_re_run_and_left_as_it_was(tmp_path, events, setup):
    run_ranks(compiled_worker, str(tmp_path), setup, tmp=tmp_path, debug="INFO" if setup == "ddp" else "DETAIL")
    one_writer(tmp_path / "run")
    acc = events(tmp_path / "run")
    reference = json.loads((tmp_path / "reference.json").read_text())
    scalars = set(acc.Tags()["scalars"])
    assert not [t for t in scalars if "_orig_mod" in t or "_wrapped_module" in t]
    modules = ["fc1", "act", "fc2"] if setup == "tensor parallel" else ["inp", "blocks.0.fc1", "blocks.1", "out"]
    prefix = "module." if setup == "ddp" else ""
    for module in modules:
        assert [e.step for e in acc.Scalars(f"activations_norm/{prefix}{module}")] == [0, 2], module
    for step in (0, 2):
        for name, norm in reference[str(step)]["weights"].items():  # exact, from the shards
            got = {e.step: e.value for e in acc.Scalars(f"weights_norm/{clean(name)}")}[step]  # (DDP's: module.)
            assert got == pytest.approx(norm, rel=1e-5), (step, name)
        if setup == "tensor parallel":  # the re-run's output of fc1, sharded over the ranks: the whole output's
            got = {e.step: e.value for e in acc.Scalars("activations_norm/fc1")}[step]
            assert got == pytest.approx(reference[str(step)]["fc1"], rel=1e-5)
    assert not [t for t in scalars if t.startswith(("bwd_ms/", "saved_bytes/"))]


class NormedAttention(nn.Module):
    """An attention block (SDPA) between BatchNorm's running buffers and a head: what DDP's
    forward broadcasts (the buffers) and what the attention probe reads (the block's heads)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        from models import SdpaBlock

        self.inp, self.block, self.norm, self.out = nn.Linear(6, d), SdpaBlock(d), nn.BatchNorm1d(d), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.inp(x))
        return self.out(self.norm(h.flatten(0, 1)))


def ddp_rerun_worker(rank: int, world: int, out: str, closure: bool) -> None:
    """DDP around a compiled model with buffers. With ``closure`` its batch is given to
    ``replay_with`` as a closure that calls DDP: rank 0 alone runs the closure again, so DDP's
    forward must broadcast nothing then (the other rank would answer with its own step's
    broadcast: a hang, or a wrong pairing). Without, the module DDP holds is run again on the
    arguments it was called with. Either way the attention inside it is measured, and training
    and Dynamo's graphs are as without layerwatch."""
    from torch.nn.parallel import DistributedDataParallel

    def build() -> nn.Module:
        return DistributedDataParallel(torch.compile(NormedAttention(), backend="aot_eager"))

    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own data
        return model(torch.randn(4, 5, 6)).pow(2).mean()

    compiled_both_ways(build, loss_of, out, lambda model, step: None, replay=closure, every_n_steps=EVERY)


@pytest.mark.parametrize("closure", [True, False], ids=["closure", "kept inputs"])
def test_a_compiled_model_under_ddp_is_run_again_on_rank_zero_alone_with_no_collective(tmp_path, events, closure):
    run_ranks(ddp_rerun_worker, str(tmp_path), closure, tmp=tmp_path, debug="INFO")
    one_writer(tmp_path / "run")
    acc = events(tmp_path / "run")
    assert [e.step for e in acc.Scalars("attention_entropy/module.block.attn")] == [0, 2]
    assert [e.step for e in acc.Scalars("activations_norm/module.norm")] == [0, 2]


def budget_worker(rank: int, world: int, out: str) -> None:
    """FSDP2 per layer at the default schedule, the overhead budget. Its measurements are
    scripted apart on purpose: rank 0's pacer wants every 5th step and rank 1's every step, so
    that only rank 0's choice, shared, keeps the ranks (and their collectives) together. Rank 1
    alone is short of memory for the update ratios' snapshot: every rank estimates them."""
    from torch.distributed.device_mesh import init_device_mesh

    from layerwatch.engine.budget import Pacer

    Pacer.ideal = scripted_ideal(lambda: 3.0 if rank == 0 else 1.0)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Stack()
    shard_stack(model, "per_layer", mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    inspector = Inspector(model, log_dir=f"{out}/run", optimizer=opt, memory_budget=0 if rank == 1 else None).start()
    sampled = [inspector.current_step] if inspector.sampled else []
    for step in range(23):
        torch.manual_seed(100 + 10 * step + rank)
        loss = model(torch.randn(4, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        inspector.step()
        if inspector.sampled:
            sampled.append(inspector.current_step)
    state = inspector.state_dict()
    inspector.finish()
    record(out, f"sampled{rank}.json", {"sampled": sampled, "state": state})


def test_fsdp2_per_layer_under_the_overhead_budget_samples_rank_zeros_steps_on_every_rank(tmp_path, events):
    run_ranks(budget_worker, str(tmp_path), tmp=tmp_path)
    ranks = [json.loads((tmp_path / f"sampled{rank}.json").read_text()) for rank in (0, 1)]
    for seen in ranks:
        assert seen == {"sampled": [0, 1, 5, 10, 15, 20], "state": {"step": 23, "sample_interval": 5}}
    acc = events(tmp_path / "run")
    logged = {e.step: e.value for e in acc.Scalars("layerwatch/sample_interval")}
    assert logged == {0: 1, 1: 5, 5: 5, 10: 5, 15: 5, 20: 5}
    ratios = [tag for tag in acc.Tags()["scalars"] if tag.startswith("update_ratio")]
    assert "update_ratio_estimate/inp.weight" in ratios and not [t for t in ratios if t.startswith("update_ratio/")]


# ---------------------------------------------------------------------- a weight NaN on one rank's shard


def poisoned_shard_worker(rank: int, world: int, out: str) -> None:
    """FSDP2 per layer, the sentinel off: after step 0, rank 1's shard of ``0.weight`` holds a
    NaN (as an optimizer leaves it after an unseen fault). At the sampled step 1, layer 0 turns
    finite inputs into NaN with the whole weight FSDP gathers: it used the fault, on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=f"{out}/run", optimizer=opt, schedule=[1], sentinel=False) as inspector:
            for step in range(2):
                opt.zero_grad()
                model(torch.randn(4, 6)).pow(2).mean().backward()
                opt.step()
                if step == 0 and rank == 1:
                    with torch.no_grad():
                        model[0].weight.to_local()[0, 0] = float("nan")  # row 5 of the whole weight
                inspector.step()
    if rank == 0:
        record(out, "alerts.json", [[a.step, a.name, a.message] for a in inspector.alerts if a.kind == "nonfinite"])


def test_fsdp2_a_nan_in_another_ranks_shard_of_a_weight_names_no_first_offender(tmp_path):
    run_ranks(poisoned_shard_worker, str(tmp_path), tmp=tmp_path)
    alerts = json.loads((tmp_path / "alerts.json").read_text())
    named = [a for a in alerts if not a[2].startswith("NaN/Inf values")]
    assert [(step, name) for step, name, _ in named] == [(1, "0")], alerts
    assert named[0][2].startswith("first module to use a non-finite weight at step 1: 0 (0.weight held NaN/Inf before")
