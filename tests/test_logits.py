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
from models import MLP, SdpaLM, layerwatch_messages


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
                loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
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
