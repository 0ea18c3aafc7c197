"""The ``moe`` family: routers found in transformers' MoE classes and named by ``moe_routers``;
tokens per expert exact, summed over micro-batches, not counted again when checkpointing
recomputes the forward; entropy, margin and log Z as computed from the logits."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import layerwatch
from layerwatch import Inspector
from layerwatch.probes.routers import find_routers
from hf_models import MOE_FAMILIES, tiny_moe

SEQ, BATCH, VOCAB = 8, 2, 64


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


class Witness:
    """The test's own record of what each router chose (the experts' top_k_index) and its logits."""

    def __init__(self, model):
        self.indices, self.logits, self.handles = {}, {}, []
        for router in find_routers(model):
            name = router.name
            self.indices[name], self.logits[name] = [], []
            self.handles.append(router.experts.register_forward_pre_hook(
                lambda m, args, name=name: self.indices[name].append(args[1].detach().clone())))
            self.handles.append(router.module.register_forward_hook(
                lambda m, args, out, name=name: self.logits[name].append(
                    (out[0] if isinstance(out, tuple) else out).detach().float().reshape(-1, out[0].shape[-1]).clone())))

    def counts(self, name, experts):
        return np.bincount(torch.cat([i.reshape(-1) for i in self.indices[name]]).numpy(), minlength=experts)

    def reset(self):
        for kept in (*self.indices.values(), *self.logits.values()):
            kept.clear()


def train(model, log_dir, steps, micro=1, **options):
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    data = batches(steps * micro)
    with Inspector(model, log_dir=log_dir, every_n_steps=1, optimizer=opt, alerts=False, histograms=False,
                   **options) as inspector:
        for step in range(steps):
            for x in data[step * micro:(step + 1) * micro]:
                (model(x, labels=x).loss / micro).backward()
            opt.step()
            opt.zero_grad()
            inspector.step()


def series(frame, name):
    return frame[frame.series == name]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_family_counts_every_token_its_router_sent(family, tmp_path):
    model = tiny_moe(family)
    routers = find_routers(model)
    assert [r.name for r in routers] == [f"model.layers.{i}.mlp.{'router' if family == 'gpt_oss' else 'gate'}"
                                         for i in range(2)]
    witness = Witness(model)
    train(model, tmp_path, steps=1)
    frame = layerwatch.load(tmp_path)
    for router in routers:
        tokens = series(frame, "moe_tokens")
        got = [float(tokens[tokens.layer == f"{router.name}#{e}"].value.iloc[0]) for e in range(4)]
        assert got == witness.counts(router.name, 4).tolist()
        assert sum(got) == BATCH * SEQ * 2
        logits = torch.cat(witness.logits[router.name])
        p = logits.softmax(-1)
        entropy = float(-(p * p.log()).sum(-1).mean())
        top = p.topk(2, -1).values
        z = torch.logsumexp(logits, -1)
        for name, expected in (("moe_entropy", entropy), ("moe_margin", float((top[:, 0] - top[:, 1]).mean())),
                               ("moe_router_z", float(z.mean())), ("moe_router_z_max", float(z.max())),
                               ("moe_imbalance", max(got) / (sum(got) / 4)), ("moe_dead", got.count(0))):
            assert float(series(frame, name).set_index("layer").value[router.name]) == pytest.approx(expected, rel=1e-4)
        bias = series(frame, "moe_bias")
        assert len(bias[bias.layer.str.startswith(router.name + "#")]) == (4 if family == "deepseek_v3" else 0)
        assert series(frame, "moe_dropped").empty  # transformers' routers have no capacity limit
    for handle in witness.handles:
        handle.remove()
    assert not any(r.module._forward_hooks or r.experts._forward_pre_hooks for r in routers)


def test_micro_batches_add_up_and_a_checkpointed_forward_counts_once(tmp_path):
    counts = {}
    for case in ("plain", "reentrant", "non-reentrant"):
        model = tiny_moe("mixtral")
        if case != "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": case == "reentrant"})
        model.train()
        witness = Witness(model) if case == "plain" else None
        train(model, tmp_path / case, steps=1, micro=3)
        tokens = series(layerwatch.load(tmp_path / case), "moe_tokens")
        counts[case] = tokens.set_index("layer").value.to_dict()
        if witness is not None:
            name = "model.layers.1.mlp.gate"
            assert [counts[case][f"{name}#{e}"] for e in range(4)] == witness.counts(name, 4).tolist()
            assert sum(counts[case][f"{name}#{e}"] for e in range(4)) == 3 * BATCH * SEQ * 2
    assert counts["reentrant"] == counts["plain"] == counts["non-reentrant"]


class TopKMoE(nn.Module):
    """A custom MoE block, torchtitan-style: a linear gate, top-k over its logits, a capacity."""

    def __init__(self, dim=16, experts=4, top_k=2):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        logits = self.gate(x)
        weights, chosen = logits.softmax(-1).topk(self.top_k, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = (chosen == e).any(-1)
            out[mask] = out[mask] + expert(x[mask]) * weights[mask][chosen[mask] == e][:, None]
        return out


class CustomModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(TopKMoE() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_custom_moe_names_its_routers_and_capacity(tmp_path):
    model = CustomModel()
    kept = []
    model.blocks[0].gate.register_forward_hook(lambda m, a, out: kept.append(out.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    routers = {"blocks.*.gate": {"top_k": 2, "capacity_factor": 1.0}}
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt, alerts=False, moe_routers=routers) as ins:
        model(x).square().mean().backward()
        opt.step()
        ins.step()
    frame = layerwatch.load(tmp_path)
    chosen = kept[0].reshape(-1, 4).topk(2, -1).indices
    counts = np.bincount(chosen.reshape(-1).numpy(), minlength=4)
    tokens = series(frame, "moe_tokens").set_index("layer").value
    assert [tokens[f"blocks.0.gate#{e}"] for e in range(4)] == counts.tolist()
    capacity = math.ceil(1.0 * 20 * 2 / 4)
    dropped = series(frame, "moe_dropped").set_index("layer").value
    assert dropped["blocks.0.gate"] == np.clip(counts - capacity, 0, None).sum()
    assert set(dropped.index) == {"blocks.0.gate", "blocks.1.gate"}


@pytest.mark.parametrize("value, match", [
    ("blocks.*.gate", "moe_routers must map"),
    ({"": 2}, "each key must be a module name pattern"),
    ({"gate": 0}, r"moe_routers\['gate'\]: top_k must be an int >= 1, got 0"),
    ({"gate": {"top_k": 2, "capacity": 1}}, r"unknown keys \['capacity'\]"),
    ({"gate": {"top_k": 2, "capacity_factor": -1.0}}, "capacity_factor must be a finite number > 0, got -1.0"),
])
def test_moe_routers_misuse_names_the_bad_value(value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Inspector(CustomModel(), moe_routers=value)


def test_a_pattern_that_names_no_router_is_said(tmp_path):
    model = CustomModel()
    with pytest.warns(RuntimeWarning, match=r"moe_routers=\['nothing\.here'\] names no module"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, alerts=False, moe_routers={"nothing.here": 2}) as ins:
            model(torch.randn(2, 16)).sum().backward()
            ins.step()


def test_off_steps_and_the_family_off_leave_routers_alone(tmp_path):
    model = tiny_moe("qwen3_moe")
    routers = find_routers(model)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    seen = []
    with Inspector(model, log_dir=tmp_path / "on", every_n_steps=3, optimizer=opt, alerts=False) as ins:
        for x in batches(4):
            model(x, labels=x).loss.backward()
            seen.append(sum(len(r.module._forward_hooks) + len(r.experts._forward_pre_hooks) for r in routers))
            opt.step()
            opt.zero_grad()
            ins.step()
    assert seen[0] > 0 and seen[1] == seen[2] == 0 and seen[3] > 0  # armed on sampled steps 0 and 3 only
    assert sorted(series(layerwatch.load(tmp_path / "on"), "moe_dead").step.unique()) == [0, 3]
    train(tiny_moe("qwen3_moe"), tmp_path / "off", steps=1, families=("weights", "grads", "attention"))
    assert not layerwatch.load(tmp_path / "off").series.str.startswith("moe").any()


class LogitsRouter(nn.Module):
    """A router that returns its logits alone (DeepSeek-V3's in early transformers 5): its block
    chooses the experts, and its experts are given them."""

    def __init__(self, dim=16, experts=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim) / 4)
        self.num_experts, self.top_k = experts, 2

    def forward(self, x):
        return x @ self.weight.T


class BlockExperts(nn.Module):
    def __init__(self, dim=16, experts=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, dim, dim) / 4)

    def forward(self, x, top_k_index, top_k_weights):
        return torch.einsum("nd,nkde,nk->ne", x, self.w[top_k_index], top_k_weights)


class BiasedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.experts = LogitsRouter(), BlockExperts()
        self.register_buffer("e_score_correction_bias", torch.tensor([0.0, 0.5, 0.0, 0.0]))

    def forward(self, x):
        scores = self.gate(x).sigmoid()
        chosen = (scores + self.e_score_correction_bias).topk(2, -1).indices  # the bias changes the routing
        return self.experts(x, chosen, scores.gather(-1, chosen))


class DeclaresItsRouter(nn.Module):
    _can_record_outputs = {"router_logits": LogitsRouter}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = BiasedBlock()

    def forward(self, x):
        return self.block(x)


def test_a_router_returning_logits_alone_is_counted_from_its_experts_inputs(tmp_path):
    model = DeclaresItsRouter()
    (router,) = find_routers(model)
    assert (router.name, router.experts is model.block.experts, router.num_experts) == ("block.gate", True, 4)
    given = []
    model.block.experts.register_forward_pre_hook(lambda m, args: given.append(args[1].clone()))
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(2))
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, alerts=False) as inspector:
        model(x).sum().backward()
        inspector.step()
    frame = layerwatch.load(tmp_path)
    tokens = series(frame, "moe_tokens").set_index("layer").value
    assert [tokens[f"block.gate#{e}"] for e in range(4)] == np.bincount(given[0].reshape(-1), minlength=4).tolist()
    bias = series(frame, "moe_bias").set_index("layer").value
    assert [bias[f"block.gate#{e}"] for e in range(4)] == [0.0, 0.5, 0.0, 0.0]


def test_ranks_are_added_by_expert_once_each_and_an_uneven_or_missing_router_is_left_out():
    from layerwatch.probes.routers import Routed, combine

    def routed(counts, entropy=1.0, bias=None):
        counts = np.array(counts, dtype=np.float64)
        return Routed(counts, np.array([counts.sum() / 2, entropy, 0.5, 3.0, 4.0]), None, bias)

    a, b = {"gate": routed([3, 1, 0, 4])}, {"gate": routed([1, 1, 2, 4], entropy=2.0)}
    together = combine([a, b])
    assert together.loads["gate"].tokens.tolist() == [4, 2, 2, 8]  # added by expert, then the ratios
    assert together.loads["gate"].imbalance == 8 / 4 and not together.repeated
    same = combine([a, b, dict(a)])  # a third rank that routed the first's tokens (tensor parallel)
    assert same.loads["gate"].tokens.tolist() == [4, 2, 2, 8] and same.repeated
    assert combine([a, None]).missing == ["gate"] and combine([a, None]).loads == {}
    uneven = combine([a, {"gate": routed([1, 1])}])
    assert uneven.uneven == ["gate"] and uneven.loads == {}


def test_an_index_out_of_range_is_left_out_and_a_nan_logit_is_no_certainty(tmp_path):
    from layerwatch.probes.routers import route_sums

    sums = route_sums(torch.tensor([[0.0, 0.0], [float("nan"), 1.0]]))
    assert sums[0] == 2 and math.isnan(float(sums[1]))  # a NaN token's entropy is NaN, not 0 (a made-up collapse)
    model = DeclaresItsRouter()
    model.block.experts.register_forward_pre_hook(
        lambda m, args: (args[0], torch.where(args[1] == 1, -1, args[1]), args[2]))  # a padding token's -1
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, alerts=False) as inspector:
        model(torch.randn(12, 16)).sum().backward()
        inspector.step()
    tokens = series(layerwatch.load(tmp_path), "moe_tokens").set_index("layer").value
    assert tokens["block.gate#1"] == 0 and tokens.sum() < 24
