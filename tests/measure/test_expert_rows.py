"""Per-expert rows of fused expert parameters (layerwatch.measure.experts): ``<param>[e]`` in the
weights' and gradients' norms and the update ratios, as ``p[e]`` computed apart, with the moe family
on, and none without it; never a TensorBoard card."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import layerwatch
from layerwatch import Inspector
from layerwatch.distributed.sharding import Layout
from layerwatch.measure.experts import ExpertRows, Split, find_splits
from layerwatch.reading.report import build_report, format_report
from layerwatch.vocabulary import FAMILIES

transformers = pytest.importorskip("transformers")

STEPS = 3
EXPERTS = 4


def mixtral() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        num_local_experts=EXPERTS, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def gpt_oss() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       num_local_experts=EXPERTS, num_experts_per_tok=2, layer_types=["full_attention"])
    return transformers.GptOssForCausalLM(config)


def fused(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if ".experts." in name}


def train(model: nn.Module, log_dir, steps: int = STEPS, **options) -> dict:
    """``steps`` AdamW steps under an Inspector sampling every step; the reference, computed apart:
    each fused parameter's experts' gradient norms, weight norms after the step and update ratios."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    seen: dict = {"grads_norm": {}, "weights_norm": {}, "update_ratio": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a short run's health rules say they cannot judge it
        with Inspector(model, log_dir=str(log_dir), every_n_steps=1, optimizer=opt, **options) as inspector:
            for step in range(steps):
                model(input_ids=tokens, labels=tokens).loss.backward()
                before = {name: p.detach().double().clone() for name, p in fused(model).items()}
                grads = {name: p.grad.double() for name, p in fused(model).items()}
                opt.step()
                inspector.step()
                opt.zero_grad()
                for name, p in fused(model).items():
                    after = p.detach().double()
                    for e in range(EXPERTS):
                        row = f"{name}[{e}]"
                        seen["grads_norm"][row, step] = grads[name][e].norm().item()
                        seen["weights_norm"][row, step] = after[e].norm().item()
                        seen["update_ratio"][row, step] = ((after[e] - before[name][e]).norm() / after[e].norm()).item()
    return seen


def loaded(log_dir) -> dict:
    frame = layerwatch.load(str(log_dir))
    return {(series, layer, step): value for series, layer, step, value in
            zip(frame["series"], frame["layer"], frame["step"], frame["value"])}


def test_each_expert_s_norms_and_update_ratio_are_its_slice_s(tmp_path, events):
    seen = train(mixtral(), tmp_path)
    got = loaded(tmp_path)
    for series, reference in seen.items():
        for (row, step), value in reference.items():
            assert got[series, row, step] == pytest.approx(value, rel=1e-5), (series, row, step)
    assert len(seen["weights_norm"]) == 2 * 2 * EXPERTS * STEPS  # two layers, gate_up_proj and down_proj
    for (series, layer, step), value in got.items():  # the experts' squares add up to the whole tensor's
        if series in ("weights_norm", "grads_norm") and layer.endswith("experts.gate_up_proj"):
            experts = [got[series, f"{layer}[{e}]", step] for e in range(EXPERTS)]
            assert float(np.sum(np.square(experts))) == pytest.approx(value ** 2, rel=1e-5)
    acc = events(tmp_path)
    tags = acc.Tags()
    assert not [tag for tag in tags["scalars"] + tags["histograms"] if tag.endswith("]")]  # the tab's only
    assert "weights_norm/model.layers.0.mlp.experts.down_proj" in tags["scalars"]
    assert "model.layers" in format_report(build_report(tmp_path))  # the report reads the rows <param>[e] too


def test_a_two_dimensional_expert_bias_has_its_rows(tmp_path):
    seen = train(gpt_oss(), tmp_path, steps=2)
    got = loaded(tmp_path)
    bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
    assert {(row, step) for row, step in seen["weights_norm"] if row.startswith(bias + "[")} == {
        (f"{bias}[{e}]", step) for e in range(EXPERTS) for step in range(2)}
    for series, reference in seen.items():
        for (row, step), value in reference.items():
            assert got[series, row, step] == pytest.approx(value, rel=1e-5), (series, row, step)


def test_without_the_moe_family_no_expert_rows(tmp_path):
    train(mixtral(), tmp_path, steps=1, families=[f for f in FAMILIES if f != "moe"])
    got = loaded(tmp_path)
    assert ("weights_norm", "model.layers.0.mlp.experts.gate_up_proj", 0) in got
    assert not [key for key in got if key[1].endswith("]")]


def test_a_rank_s_experts_of_a_dim_0_shard_and_the_others_empty():
    rows = ExpertRows()
    rows.start({"w": Split(5, 2), "b": Split(5, 0)})
    plan = rows.plan(["x", "w", "b"])
    assert plan.names == [f"w[{e}]" for e in range(5)] + [f"b[{e}]" for e in range(5)]
    assert rows.plan(["x", "w", "b"]) is plan  # made once per list of names
    w, b = torch.arange(24.0).view(2, 3, 4), torch.ones(5, 3)  # this rank holds experts 2 and 3 of w
    pieces = rows.slices(plan, [torch.zeros(1), w, b])
    assert [p.numel() for p in pieces[:5]] == [0, 0, 12, 12, 0]
    assert pieces[2].data_ptr() == w.data_ptr() and torch.equal(pieces[3], w[1])  # views, no copy
    assert all(torch.equal(p, b[e]) for e, p in enumerate(pieces[5:]))
    assert rows.slices(plan, [torch.zeros(1), torch.zeros(4, 3, 4), b]) is None  # more than the split leaves room for
    rows.start({"w": Split(5, None)})
    assert rows.slices(rows.plan(["w"]), [w]) is None  # unknown: this rank's pieces read as failed


def test_experts_held_flattened_are_left_out_and_said_once():
    model, said = mixtral(), []
    every = find_splits(model, None, Layout(), None, lambda key, message: said.append(message))
    assert every == {f"model.layers.{i}.mlp.experts.{p}": Split(EXPERTS, 0) for i in (0, 1) for p in ("gate_up_proj", "down_proj")}
    assert not said
    fsdp1 = Layout(pieces={"model.layers.0.mlp.experts.gate_up_proj": (None, None)},
                   flattened={"model.layers.1.mlp.experts.w": (8, torch.float32, True)})  # use_orig_params=False: not on the module
    assert set(find_splits(model, None, fsdp1, None, lambda key, message: said.append(message))) == set(every) - {
        "model.layers.0.mlp.experts.gate_up_proj"}
    assert find_splits(model, None, Layout(), object(), lambda key, message: said.append(message)) == {}  # ZeRO
    assert "FSDP1's flat parameters" in said[0] and "model.layers.1.mlp.experts.w" in said[0]
    assert "DeepSpeed ZeRO" in said[1] and len(said) == 2
