"""The output head's log Z (the "logits" family): the mean and largest logsumexp of the logits a
sampled forward made, at the head Hugging Face names or the ``output_head`` option names; the
logit_drift alert provoked by a shift every logit shares, which the loss cannot see."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from layerwatch import Inspector
from layerwatch.probes.logits import find_output_head
from models import MLP, SdpaLM, layerwatch_messages, lm_step, tab_values


def run(log_dir, steps=6, every=2, before_step=None, **options):
    torch.manual_seed(0)
    model = SdpaLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    seen, losses = {}, []
    model.head.register_forward_hook(lambda m, a, out: seen.update({len(losses): out.detach().clone()}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=log_dir, every_n_steps=every, optimizer=opt, output_head="head", **options) as inspector:
            for k in range(steps):
                if before_step is not None:
                    before_step(model, k)
                ids = torch.randint(0, 32, (4, 12), generator=generator)
                loss = lm_step(model, opt, ids)
                losses.append(loss.item())
                inspector.step()
    return inspector, losses, seen


def test_the_named_heads_log_z_is_written_at_sampled_steps(tmp_path, events):
    _, _, seen = run(tmp_path)
    acc = events(tmp_path)
    for step in (2, 4):  # from the second sampled step on
        log_z = torch.logsumexp(seen[step].float(), dim=-1)
        assert {e.step: e.value for e in acc.Scalars("logsumexp_mean/head")}[step] == pytest.approx(log_z.mean().item(), rel=1e-6)
        assert {e.step: e.value for e in acc.Scalars("logsumexp_max/head")}[step] == pytest.approx(log_z.max().item(), rel=1e-6)


def test_hugging_faces_output_embeddings_are_the_head_by_default():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    assert find_output_head(model, None) == ("lm_head", model.lm_head)
    assert find_output_head(SdpaLM(), None) is None and find_output_head(SdpaLM(), "head")[0] == "head"


def test_a_head_that_names_no_module_is_said_once_and_a_bad_value_refused(tmp_path, recwarn):
    with pytest.raises(ValueError, match="output_head must name a module .*got ''"):
        Inspector(MLP(), log_dir=tmp_path, output_head="")
    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, output_head="lm_head") as inspector:
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            inspector.step()
    assert sum("output_head='lm_head' names no module" in m for m in layerwatch_messages(recwarn)) == 1


def test_a_shift_every_logit_shares_raises_logit_drift_and_leaves_the_loss(tmp_path):
    def shift(model, k):
        if k == 20:
            with torch.no_grad():
                model.head.bias += 20.0  # the softmax, and so the loss, cannot see it

    drifted, losses, _ = run(tmp_path / "drift", steps=40, before_step=shift)
    alerts = [(a.name, a.step) for a in drifted.alerts if a.kind == "logit_drift"]
    assert len(alerts) == 1 and alerts[0][0] == "head" and 20 < alerts[0][1] <= 30
    assert "AlertRules.logit_drift" in next(a.message for a in drifted.alerts if a.kind == "logit_drift")
    healthy, healthy_losses, _ = run(tmp_path / "healthy", steps=40)
    assert not [a for a in healthy.alerts if a.kind == "logit_drift"]
    assert losses[20] == pytest.approx(healthy_losses[20], rel=1e-4)


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()", "torch.compile(loss_fn)"])
def test_log_z_kurtosis_and_attention_of_a_compiled_model_are_eagers(tmp_path, events, how):
    """A compiled model's head log Z, each block's kurtosis and each attention call's heads come
    from the eager re-run of each sampled step's micro-batch, under the names eager gives them,
    at every sampled step (a model called from a compiled function too: its first sample finds
    it, before the optimizer step, and runs the batch ``replay_with`` gave again then), and the
    values are eager's. Nothing compiles for them, and the losses are bitwise those of the run
    without layerwatch."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from models import compile_as

    def train(log_dir, how, watch=True):
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend("aot_eager")
        torch.manual_seed(0)
        model = SdpaLM()
        call = compile_as(model, how, counter)
        forward = torch.compile(lambda x: call(x), backend=counter) if how == "torch.compile(loss_fn)" else call
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(1)
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inspector = Inspector(call, log_dir=log_dir, every_n_steps=2, optimizer=opt, output_head="head").start() if watch else None
            for _ in range(7):
                ids = torch.randint(0, 32, (4, 12), generator=generator)
                if inspector is not None:
                    inspector.replay_with(lambda ids=ids: F.cross_entropy(forward(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()))
                loss = lm_step(forward, opt, ids)
                losses.append(repr(loss.item()))
                if inspector is not None:
                    inspector.step()
            if inspector is not None:
                inspector.finish()
        return losses, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    eager_losses, _, _ = train(tmp_path / "eager", "eager")
    plain_losses, plain_graphs, _ = train(None, how, watch=False)
    losses, graphs, breaks = train(tmp_path / "compiled", how)
    assert losses == plain_losses == eager_losses and breaks == 0
    assert graphs == plain_graphs
    eager, compiled = events(tmp_path / "eager"), events(tmp_path / "compiled")
    for tag in ("logsumexp_mean/head", "logsumexp_max/head"):
        expected = {e.step: e.value for e in eager.Scalars(tag)}
        assert set(expected) == {0, 2, 4, 6}  # from the first sample on
        assert [e.step for e in compiled.Scalars(tag)] == [0, 2, 4, 6]
        for e in compiled.Scalars(tag):
            assert e.value == pytest.approx(expected[e.step], rel=1e-5), (tag, e.step)
    eager_tab, compiled_tab = tab_values(eager), tab_values(compiled)
    blocks = sorted(t for t in eager_tab if t.startswith("activations_kurtosis/"))
    assert blocks == [f"activations_kurtosis/{name}" for name in
                      ("(root)", "blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "blocks.1.attn", "blocks.1.mlp")]
    assert sorted(t for t in compiled_tab if t.startswith("activations_kurtosis/")) == blocks
    heads = sorted(t for t in eager_tab if t.startswith("attention_head_"))
    assert len(heads) == 2 * 2 * 2  # two statistics, two layers, two heads
    assert sorted(t for t in compiled_tab if t.startswith("attention_head_")) == heads
    for tag in blocks + heads:
        assert sorted(compiled_tab[tag]) == sorted(eager_tab[tag]) == [0, 2, 4, 6], tag
        for step in (0, 2, 4, 6):
            assert compiled_tab[tag][step] == pytest.approx(eager_tab[tag][step], rel=1e-4), (tag, step)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # torch's again
