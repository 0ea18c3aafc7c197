"""Attention per layer and per head (the "attention" family): the largest logit and the entropy
of every scaled_dot_product_attention call of a sampled forward, exact on its sampled query
rows, with the run unchanged; the attention_logits and entropy_collapse alerts provoked by
scaling a layer's query and key weights."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layerwatch import Inspector
from layerwatch.probes.attention import ROWS, attention_stats
from models import SdpaLM, lm_step, tab_values

ORIGINAL = F.scaled_dot_product_attention


def brute_force(q, k, mask=None, causal=False, scale=None, gqa=False):
    """Every row's logits, as the kernel computes them, in float64: ``[heads, 2]``."""
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    logits = q.double() @ k.double().transpose(-2, -1) * (scale or q.shape[-1] ** -0.5)
    if causal:
        logits = logits.masked_fill(~torch.ones(logits.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    heads = logits.transpose(-3, 0).reshape(logits.shape[-3], -1, logits.shape[-1])
    entropy = torch.special.entr(heads.softmax(-1)).sum(-1)
    seen = entropy.isfinite()
    return torch.stack([heads.amax((1, 2)), torch.where(seen, entropy, 0).sum(-1) / seen.sum(-1)], 1)


@pytest.mark.parametrize("case", ["plain", "causal", "bool mask", "float mask and scale", "grouped query heads", "a masked row"])
def test_the_statistics_are_those_of_every_row_when_they_are_all_sampled(case):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8)
    kwargs, reference = {}, {}
    if case == "causal":
        kwargs = reference = {"is_causal": True}
        reference = {"causal": True}
    elif case in ("bool mask", "a masked row"):
        mask = torch.rand(2, 1, 10, 10) > 0.4
        mask[..., 0] = case == "bool mask"  # a row with no key left is left out of the entropy
        kwargs, reference = {"attn_mask": mask}, {"mask": mask}
    elif case == "float mask and scale":
        mask = torch.randn(10, 10)
        kwargs, reference = {"attn_mask": mask, "scale": 0.3}, {"mask": mask, "scale": 0.3}
    elif case == "grouped query heads":
        k = torch.randn(2, 2, 10, 8)
        kwargs, reference = {"enable_gqa": True}, {"gqa": True}
    got = attention_stats(q, k, **kwargs)
    torch.testing.assert_close(got.double(), brute_force(q, k, **reference), rtol=1e-5, atol=1e-5)


def test_a_long_sequence_is_measured_on_a_sample_of_its_query_rows():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 500, 8), torch.randn(1, 2, 500, 8)
    got, every = attention_stats(q, k, is_causal=True), brute_force(q, k, causal=True)
    assert (got[:, 0] <= every[:, 0] + 1e-5).all()  # the largest of a sample: never above the whole's
    index = torch.linspace(0, 499, ROWS).round().long()
    rows = brute_force(q[:, :, index], k[:, :, : index.max() + 1], mask=torch.arange(index.max() + 1) <= index[:, None])
    torch.testing.assert_close(got.double(), rows, rtol=1e-5, atol=1e-5)


def run(log_dir, steps=6, every=2, before_step=None, model=None, **options):
    torch.manual_seed(0)
    model = SdpaLM() if model is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses, stacks = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inspector = Inspector(model, log_dir=log_dir, every_n_steps=every, optimizer=opt, **options).start() if log_dir else None
        for k in range(steps):
            if before_step is not None:
                before_step(model, k)
            ids = torch.randint(0, 32, (4, 12), generator=generator)
            loss = lm_step(model, opt, ids)
            losses.append(loss.item())
            if inspector is not None:
                inspector.step()
            stacks.append(F.scaled_dot_product_attention is ORIGINAL)
        if inspector is not None:
            inspector.finish()
    return inspector, losses, stacks, model


def test_each_attention_module_gets_its_calls_statistics_and_the_run_is_unchanged(tmp_path, events):
    seen = {}

    def keep(name):
        def hook(module, args, output):
            seen.setdefault(name, []).append(output.detach().clone())
        return hook

    torch.manual_seed(0)
    model = SdpaLM()
    for b, block in enumerate(model.blocks):
        block.attn.q.register_forward_hook(keep(f"{b}.q"))
        block.attn.k.register_forward_hook(keep(f"{b}.k"))
    _, losses, stacks, _ = run(tmp_path, model=model)
    _, plain_losses, _, _ = run(None)
    assert losses == plain_losses
    assert stacks == [True] * 6  # the wrapper stands in during a sampled forward only
    tab = tab_values(events(tmp_path))
    for b in range(2):
        split = lambda t: t.view(4, 11, 2, 8).transpose(1, 2)  # noqa: E731
        for step in (0, 2, 4):  # from the first sampled step on
            expected = brute_force(split(seen[f"{b}.q"][step]), split(seen[f"{b}.k"][step]), causal=True)
            name = f"blocks.{b}.attn"
            assert tab[f"attention_logit_max/{name}"][step] == pytest.approx(expected[:, 0].max().item(), rel=1e-5)
            assert tab[f"attention_entropy/{name}"][step] == pytest.approx(expected[:, 1].min().item(), rel=1e-5)
            for h in range(2):
                assert tab[f"attention_head_logit_max/{name}#{h}"][step] == pytest.approx(expected[h, 0].item(), rel=1e-5)
                assert tab[f"attention_head_entropy/{name}#{h}"][step] == pytest.approx(expected[h, 1].item(), rel=1e-5)
    scalars = events(tmp_path).Tags()["scalars"]
    assert "attention_logit_max/blocks.0.attn" in scalars and not [t for t in scalars if t.startswith("attention_head")]


def test_torch_transformer_layers_are_seen_through_multihead_attention(tmp_path, events):
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                  enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
        for _ in range(3):
            model(torch.randn(3, 7, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            inspector.step()
    tab = tab_values(events(tmp_path))
    assert sorted(t for t in tab if t.startswith("attention_logit_max/")) == [
        "attention_logit_max/layers.0.self_attn", "attention_logit_max/layers.1.self_attn"]
    assert F.scaled_dot_product_attention is ORIGINAL


class AsksForWeights(nn.Module):
    """``nn.MultiheadAttention`` called for its weights (its default), with a key padding mask
    and a bool causal mask: torch computes them without SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.weights = nn.MultiheadAttention(16, 4, batch_first=True), None

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        causal = ~torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()  # True: not attended
        out, self.weights = self.attn(x, x, x, key_padding_mask=padding, attn_mask=causal)
        return out


def test_multihead_attention_asked_for_its_weights_is_measured_and_returns_them_unchanged(tmp_path, events):
    torch.manual_seed(0)
    model = AsksForWeights()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, padding = torch.randn(3, 7, 16), torch.zeros(3, 7, dtype=torch.bool)
    padding[0, 5:] = True  # the first sequence's last two keys are padding
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
        for step in range(3):
            out = model(x, padding)
            if step == 2:
                w_q, w_k, _ = model.attn.in_proj_weight.detach().chunk(3)
                b_q, b_k, _ = model.attn.in_proj_bias.detach().chunk(3)
                split = lambda t: t.view(3, 7, 4, 4).transpose(1, 2)  # noqa: E731
                q, k = split(F.linear(x, w_q, b_q)), split(F.linear(x, w_k, b_k))
                keep = torch.ones(7, 7, dtype=torch.bool).tril() & ~padding[:, None, None, :]
                expected = brute_force(q, k, mask=keep)
                weights, plain = model.weights, model.attn(x, x, x, key_padding_mask=padding,
                                                           attn_mask=~torch.ones(7, 7, dtype=torch.bool).tril())
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            inspector.step()
    assert torch.equal(weights, plain[1]) and weights.shape == (3, 7, 7)  # averaged over the heads, as asked
    tab = tab_values(events(tmp_path))
    got = [[tab[f"attention_head_{stat}/attn#{h}"][2] for stat in ("logit_max", "entropy")] for h in range(4)]
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5)
    assert F.multi_head_attention_forward.__module__ == "torch.nn.functional"


def test_a_forward_that_raises_puts_torchs_function_back(tmp_path):
    class Raises(SdpaLM):
        def forward(self, ids):
            super().forward(ids)
            raise RuntimeError("boom")

    model = Raises()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
        inspector.step()
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randint(0, 32, (2, 5)))
        assert F.scaled_dot_product_attention is ORIGINAL  # at once
    assert F.scaled_dot_product_attention is ORIGINAL


def test_the_family_can_be_turned_off_and_no_mode_is_left(tmp_path, events):
    _, _, stacks, _ = run(tmp_path, families=("weights", "grads", "latency"))
    assert not [t for t in tab_values(events(tmp_path)) if t.startswith("attention")]
    assert stacks == [True] * 6


def scale_queries_and_keys(layer: int, at: int, factor: float):
    def before_step(model, k):
        if k == at:
            with torch.no_grad():
                for linear in (model.blocks[layer].attn.q, model.blocks[layer].attn.k):
                    linear.weight.mul_(factor)
                    linear.bias.mul_(factor)
    return before_step


def alerts_of(inspector, kind):
    return [(a.name, a.step) for a in inspector.alerts if a.kind == kind]


def test_queries_and_keys_scaled_up_raise_attention_logits_and_entropy_collapse_on_their_layer(tmp_path):
    inspector, _, _, _ = run(tmp_path / "scaled", steps=40, every=2, before_step=scale_queries_and_keys(1, 20, 12.0))
    logits, collapse = alerts_of(inspector, "attention_logits"), alerts_of(inspector, "entropy_collapse")
    assert [name for name, _ in logits] == ["blocks.1.attn"] and 20 <= logits[0][1] <= 30
    assert [name for name, _ in collapse] == ["blocks.1.attn"] and 20 <= collapse[0][1] <= 30
    healthy, _, _, _ = run(tmp_path / "healthy", steps=40, every=2)
    assert not alerts_of(healthy, "attention_logits") + alerts_of(healthy, "entropy_collapse")


def test_a_logit_above_the_level_alerts_at_once(tmp_path):
    inspector, _, _, _ = run(tmp_path, steps=8, every=2, before_step=scale_queries_and_keys(0, 4, 60.0))  # sampled from step 2
    (alert,) = [a for a in inspector.alerts if a.kind == "attention_logits"]
    assert (alert.name, alert.step) == ("blocks.0.attn", 4)
    assert "AlertRules.attention_logit_level" in alert.message


def test_a_compiled_models_attention_comes_from_its_re_run_with_eagers_values_and_torchs_functions_back(tmp_path, events):
    """A compiled model's attention is measured on the eager re-run of each sampled step (the
    wrapper stands in for that forward alone: torch's functions are back after, and compiled code
    never sees it; tests/probes/test_logits.py compares its values with eager's). torch's
    TransformerEncoder, whose MultiheadAttention Dynamo keeps as one node: each call measured once
    a sampled step, with eager's values, under eager's name."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.compile(SdpaLM(), backend="eager")
    _, losses, stacks, _ = run(tmp_path / "lm", steps=4, model=model)
    assert all(np.isfinite(losses)) and stacks == [True] * 4 and F.scaled_dot_product_attention is ORIGINAL

    def encoder_run(log_dir, backend):
        torch._dynamo.reset()
        torch.manual_seed(0)
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                        enable_nested_tensor=False)
        call = encoder if backend is None else torch.compile(encoder, backend=backend)
        opt = torch.optim.SGD(encoder.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Inspector(call, log_dir=log_dir, every_n_steps=1, optimizer=opt) as inspector:
                for _ in range(3):
                    call(torch.randn(3, 7, 16, generator=generator)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    inspector.step()
        return tab_values(events(log_dir))

    eager = encoder_run(tmp_path / "eager", None)
    heads = sorted(t for t in eager if t.startswith("attention_head_"))
    assert len(heads) == 2 * 2 * 2
    for backend in ("eager", "aot_eager"):
        compiled = encoder_run(tmp_path / backend, backend)
        assert sorted(t for t in compiled if t.startswith("attention_head_")) == heads
        for tag in heads:
            assert sorted(compiled[tag]) == sorted(eager[tag]) == [0, 1, 2], (backend, tag)
            for step in (0, 1, 2):
                assert compiled[tag][step] == pytest.approx(eager[tag][step], rel=1e-5), (backend, tag, step)
    assert F.multi_head_attention_forward.__module__ == "torch.nn.functional"
    assert F.scaled_dot_product_attention is ORIGINAL


def causal_stats(q, k):
    return attention_stats(q, k, is_causal=True)


def train_watched(model: nn.Module, rank: int, out: str, batch_seed, whole_weight, stats=causal_stats) -> None:
    """5 AdamW steps of a sharded SdpaLM under an Inspector sampling every 2 steps, step ``s``'s
    batch drawn from seed ``batch_seed(s)``; rank 0 saves, per step, each attention's heads as
    ``stats(q, k)`` (``[heads, 2]``) computes them from the whole weights (``whole_weight(parameter)``)."""
    import json
    from pathlib import Path

    whole, now = {}, [0]
    names = {id(block.attn): f"blocks.{i}.attn" for i, block in enumerate(model.blocks)}

    def reference(module, args, output):
        (x,) = args
        split = lambda t: t.view(x.shape[0], x.shape[1], module.heads, module.head_dim).transpose(1, 2)  # noqa: E731
        q, k = (split(F.linear(x, whole_weight(layer.weight), whole_weight(layer.bias))) for layer in (module.q, module.k))
        whole.setdefault(now[0], {})[names[id(module)]] = stats(q, k).tolist()

    for block in model.blocks:
        block.attn.register_forward_hook(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=str(Path(out, "run")), every_n_steps=2, optimizer=opt) as inspector:
            for step in range(5):
                now[0] = step
                torch.manual_seed(batch_seed(step))
                ids = torch.randint(0, 32, (4, 12))
                lm_step(model, opt, ids)
                inspector.step()
    if rank == 0:
        Path(out, "whole.json").write_text(json.dumps(whole))


def tensor_parallel_worker(rank: int, world: int, out: str, flex: bool = False) -> None:
    """SdpaLM with 4 heads per attention, its q, k and v column-wise and o row-wise over the two
    ranks (each computes 2 heads), the same batch on both; with ``flex``, its attention through
    FlexAttention (torch's CPU refusal of gradients lifted, as tests/probes/test_flex_attention.py does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from models import SdpaAttention, min_entropy_heads

    stats = causal_stats
    if flex:
        import torch.nn.attention.flex_attention as FA

        FA._validate_device, stats = lambda query, key, value: None, min_entropy_heads
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = SdpaLM()
    for block in model.blocks:
        block.attn = SdpaAttention(16, heads=4, flex=flex)
        parallelize_module(block.attn, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                              "o": RowwiseParallel()})
    train_watched(model, rank, out, lambda step: 100 + step, lambda p: p.full_tensor(), stats)


@pytest.mark.parametrize("flex", [False, True], ids=["sdpa", "flex"])
def test_under_tensor_parallel_every_ranks_heads_are_gathered_in_order(tmp_path, events, flex):
    import json

    from ranks import run_ranks

    run_ranks(tensor_parallel_worker, str(tmp_path), flex, tmp=tmp_path)
    whole = json.loads((tmp_path / "whole.json").read_text())
    tab = tab_values(events(tmp_path / "run"))
    acc = events(tmp_path / "run")
    for step in (2, 4):  # from the second sampled step on
        for name in ("blocks.0.attn", "blocks.1.attn"):
            expected = np.array(whole[str(step)][name])
            assert len(expected) == 4
            got = [[tab[f"attention_head_{stat}/{name}#{h}"][step] for stat in ("logit_max", "entropy")] for h in range(4)]
            np.testing.assert_allclose(got, expected, rtol=1e-4)
            assert {e.step: e.value for e in acc.Scalars(f"attention_logit_max/{name}")}[step] == pytest.approx(expected[:, 0].max(), rel=1e-4)
    assert not [t for t in tab if "#4" in t]  # four heads, not two ranks' two each side by side twice


def fsdp2_worker(rank: int, world: int, out: str) -> None:
    """SdpaLM sharded per block and at its root (FSDP2), each rank on its own batch (FSDP2 holds
    the whole weights during the forward)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = SdpaLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    train_watched(model, rank, out, lambda step: 100 + 10 * rank + step, lambda p: p)


def test_under_fsdp2_per_block_rank_0_writes_its_own_micro_batchs_heads(tmp_path, events):
    import json

    from ranks import run_ranks

    run_ranks(fsdp2_worker, str(tmp_path), tmp=tmp_path)
    whole = json.loads((tmp_path / "whole.json").read_text())
    tab = tab_values(events(tmp_path / "run"))
    for step in (2, 4):
        for name in ("blocks.0.attn", "blocks.1.attn"):
            got = [[tab[f"attention_head_{stat}/{name}#{h}"][step] for stat in ("logit_max", "entropy")] for h in range(2)]
            np.testing.assert_allclose(got, np.array(whole[str(step)][name]), rtol=1e-5)
    assert "activations_kurtosis/blocks.0" in tab  # each rank's own output, as its activations
