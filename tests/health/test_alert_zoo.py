"""The health alerts against real runs: healthy short trainings of real architectures raise
none at the default rules, over at least two full windows; real faults are each caught.

Every run: ``Inspector(model, every_n_steps=EVERY, optimizer=opt)`` at the defaults, ``STEPS``
steps, so ``STEPS // EVERY`` samples: two windows of five at the defaults. docs/alerts.md
tabulates these runs.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from layerwatch import Inspector
from models import MLP, Poison, SmallCNN

STEPS, EVERY = 36, 3
VOCAB, SEQ, BATCH = 128, 16, 8


def watched_run(log_dir: Path, model: nn.Module, batch: Callable[[int], dict],
                loss_of: Callable[[nn.Module, dict], torch.Tensor], opt: torch.optim.Optimizer, *,
                before_step: Callable[[nn.Module, int], None] = lambda m, k: None) -> list:
    """``STEPS`` steps of ``opt`` on ``loss_of(model, batch(k))``, watched at the defaults, the loss
    given to the spike check (it judges the steps after its warm-up of 32); the alerts."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the alerts are read from the inspector, not from warnings
        with Inspector(model, every_n_steps=EVERY, optimizer=opt, log_dir=log_dir) as inspector:
            for k in range(STEPS):
                before_step(model, k)
                loss = loss_of(model, batch(k))
                opt.zero_grad()
                loss.backward()
                opt.step()
                inspector.step(loss=loss)
    return inspector.alerts


# ---------------------------------------------------------------------- healthy: real architectures


def transformers_model(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "BERT":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=32))
    if kind == "RoBERTa":
        return transformers.RobertaForMaskedLM(transformers.RobertaConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=40))
    if kind == "DistilBERT":
        return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=64, n_layers=2, n_heads=2, hidden_dim=128, max_position_embeddings=32))
    if kind == "ViT":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=128, num_labels=10))
    if kind == "GPT-2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
    if kind == "Llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=32))
    if kind == "Mistral":  # grouped-query attention: 4 heads, 2 key-value heads; a sliding window
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=32, sliding_window=8))
    if kind == "Qwen2":  # grouped-query attention, biases on q, k and v
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
            intermediate_size=128, max_position_embeddings=32))
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, decoder_start_token_id=0,
        pad_token_id=0))


def transformers_batch(kind: str) -> Callable[[int], dict]:
    generator = torch.Generator().manual_seed(1)

    def batch(k: int) -> dict:
        if kind == "ViT":
            return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=generator),
                    "labels": torch.randint(0, 10, (BATCH,), generator=generator)}
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
        return {"input_ids": ids, "labels": ids}

    return batch


ARCHITECTURES = ["BERT", "RoBERTa", "DistilBERT", "ViT", "GPT-2", "Llama", "Mistral", "Qwen2", "T5"]


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_healthy_real_architectures_raise_no_alert(kind, tmp_path):
    """BERT-like models raised ``vanishing`` on every attention query and key: their key bias's
    gradient is zero by construction (softmax ignores what it adds to a row's logits), and at
    initialization their query and key gradients sit 10,000x below the largest layer's."""
    model = transformers_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert watched_run(tmp_path, model, transformers_batch(kind), lambda m, b: m(**b).loss, opt) == []


def regression(d_in: int = 8) -> Callable[[int], dict]:
    generator = torch.Generator().manual_seed(1)

    def batch(k: int) -> dict:
        x = torch.randn(32, d_in, generator=generator)
        return {"x": x, "y": x[:, :1].sin()}

    return batch


def mse(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]).pow(2).mean()


def test_healthy_cnn_and_mlp_of_our_own_raise_no_alert(tmp_path):
    torch.manual_seed(0)
    cnn = SmallCNN()
    generator = torch.Generator().manual_seed(1)

    def images(k: int) -> dict:
        return {"x": torch.randn(16, 1, 28, 28, generator=generator), "y": torch.randint(0, 10, (16,), generator=generator)}

    cross_entropy = lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"])  # noqa: E731
    assert watched_run(tmp_path / "cnn", cnn, images, cross_entropy, torch.optim.Adam(cnn.parameters(), lr=1e-3)) == []
    torch.manual_seed(0)
    mlp = MLP(d_out=1)
    assert watched_run(tmp_path / "mlp", mlp, regression(), mse, torch.optim.SGD(mlp.parameters(), lr=0.05)) == []


# ---------------------------------------------------------------------- broken: each caught


class SigmoidStack(nn.Module):
    """A Linear, then four Sigmoid-Linear pairs, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.stack = nn.Sequential(*[m for _ in range(4) for m in (nn.Sigmoid(), nn.Linear(16, 16))])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.first(x)))


class Detached(nn.Module):
    """``first``'s output is detached (a ``.detach()`` left in by mistake): no gradient reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.first(x)).detach())


def saturate_at(step: int) -> Callable[[nn.Module, int], None]:
    """At ``step``, two Sigmoids of the stack saturate (their Linears' biases pushed to +12, as a
    bad checkpoint load might): the gradient no longer reaches the layers before them."""

    def before_step(model: nn.Module, k: int) -> None:
        if k == step:
            with torch.no_grad():
                for i in (1, 3):
                    model.stack[i].bias += 12.0

    return before_step


def zeroed_fc1() -> nn.Module:
    """An MLP whose ``fc1`` a bug initialized to zero: before a ReLU, no gradient ever reaches it."""
    model = MLP(d_out=1)
    with torch.no_grad():
        model.fc1.weight.zero_()
        model.fc1.bias.zero_()
    return model


def broken(case: str, log_dir: Path) -> tuple[list, int]:
    """The alerts of the broken run ``case``, and the step its fault began at."""
    torch.manual_seed(0)
    run = functools.partial(watched_run, log_dir)
    if case == "the gradient no longer reaches a layer (saturated sigmoids)":
        model = SigmoidStack()
        return run(model, regression(), mse, torch.optim.SGD(model.parameters(), lr=0.05),
                           before_step=saturate_at(18)), 18
    if case == "a layer detached from the loss":
        model = Detached()
        return run(model, regression(), mse, torch.optim.SGD(model.parameters(), lr=0.05)), 0
    if case == "a learning rate high enough to explode":
        model = MLP(d_out=1)
        return run(model, regression(), mse, torch.optim.SGD(model.parameters(), lr=1.5)), 0
    if case == "a layer zeroed by a bug":
        model = zeroed_fc1()
        return run(model, regression(), mse, torch.optim.SGD(model.parameters(), lr=0.05)), 0
    if case == "a parameter frozen by mistake (left out of the optimizer)":
        model = MLP(d_out=1)
        return run(model, regression(), mse, torch.optim.SGD(model.fc2.parameters(), lr=0.05)), 0
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Poison(step=20), nn.Linear(16, 1))  # NaN
    return run(model, regression(), mse, torch.optim.SGD(model.parameters(), lr=0.05)), 20


BROKEN = {  # case -> the (kind, layer) that must be among its alerts
    "the gradient no longer reaches a layer (saturated sigmoids)": ("vanishing", "first"),
    "a layer detached from the loss": ("stuck", "first"),
    # It reaches NaN within two samples, before two windows of samples can be compared.
    "a learning rate high enough to explode": ("nonfinite", "fc1"),
    "a layer zeroed by a bug": ("dead", "fc1"),
    "a parameter frozen by mistake (left out of the optimizer)": ("stuck", "fc1"),
    "NaN": ("nonfinite", "0"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_real_faults_are_caught(case, tmp_path):
    alerts, began = broken(case, tmp_path)
    kind, layer = BROKEN[case]
    caught = [a for a in alerts if (a.kind, a.name) == (kind, layer)]
    assert caught, [(a.kind, a.name, a.step) for a in alerts]
    assert began <= caught[0].step < STEPS
    assert "AlertRules" in caught[0].message or kind == "nonfinite"  # says which threshold it crossed
