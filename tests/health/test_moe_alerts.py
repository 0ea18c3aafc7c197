"""The Mixture-of-Experts routers' health rules (``router_collapse``, ``dead_expert``,
``router_z_growth``, ``routing_entropy_collapse``), each router judged against its own past:
quiet on healthy training of tiny configurations of six transformers MoE families, and quick on
a collapse and a dead expert injected into a real router. docs/alerts.md tabulates these runs.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from torch import nn

from layerwatch import AlertRules, Inspector
from layerwatch.vocabulary import FAMILIES as FAMILY_NAMES
from layerwatch.health.check import HealthMonitor
from layerwatch.probes.result import ProbeResult, RouterLoad
from layerwatch.routing import concentration
from models import tab_values

VOCAB, SEQ, BATCH, EXPERTS = 64, 16, 8, 8
ROUTER = "model.layers.0.mlp.gate"

# ---------------------------------------------------------------------- the rules on made-up loads


def loads(tokens, entropy: float = 2.0, z: float = 2.1, top_k: int = 2) -> ProbeResult:
    return ProbeResult([], None, routers={"r": RouterLoad(np.array(tokens), entropy, 0.1, z, z + 0.1, top_k=top_k)})


def feed(monitor: HealthMonitor, samples: list, loss=None) -> list:
    return [a for step, probes in enumerate(samples)
            for a in monitor.observe(step, weights={}, grads=None, trainable=[], probes=probes, loss=loss)]


BALANCED = [18, 14, 16, 17, 15, 16, 16, 16]  # 64 tokens, top-2
ONTO_ONE = [64, 10, 9, 9, 8, 8, 10, 10]  # every token sent to expert 0


def test_concentration_is_the_way_from_the_fair_share_to_every_token():
    assert concentration(np.array([16] * 8), 2) == 0
    assert concentration(np.array(ONTO_ONE), 2) == 1  # one expert takes every token: collapsed, whatever the second
    assert concentration(np.array([64, 64, 0, 0, 0, 0, 0, 0]), 2) == 1
    assert concentration(np.array([48, 16, 16, 16, 8, 8, 8, 8]), 2) == pytest.approx((48 / 64 - 0.25) / 0.75)
    assert math.isnan(concentration(np.array([16] * 8), None)) and math.isnan(concentration(np.array([8, 8]), 2))


def test_a_collapse_is_said_at_its_second_sample_once_two_windows_are_seen():
    """The windows: ``window`` (5) samples before, the last 3 now. With 7 samples, none; a
    collapse's second sample moves the median of 3."""
    assert feed(HealthMonitor(AlertRules()), [loads(BALANCED)] * 3 + [loads(ONTO_ONE)] * 4) == []
    found = feed(HealthMonitor(AlertRules()), [loads(BALANCED)] * 8 + [loads(ONTO_ONE)] * 3)
    assert [(a.kind, a.name, a.step) for a in found] == [("router_collapse", "r", 9)]
    assert "onto expert r#0: it took 64 of the 64 tokens" in found[0].message
    assert "AlertRules.router_collapse is 0.8" in found[0].message
    one_odd_batch = [loads(BALANCED)] * 8 + [loads(ONTO_ONE)] + [loads(BALANCED)] * 5
    assert feed(HealthMonitor(AlertRules()), one_odd_batch) == []


def test_a_router_routed_so_from_its_first_sample_did_not_collapse_and_its_idle_experts_are_dead():
    two = [64, 64, 0, 0, 0, 0, 0, 0]
    found = feed(HealthMonitor(AlertRules()), [loads(two)] * 12)
    assert {a.kind for a in found} == {"dead_expert"}
    assert [a.name for a in found] == [f"r#{e}" for e in range(2, 8)] and {a.step for a in found} == {4}


def test_a_dead_expert_needs_a_window_of_samples_with_enough_tokens():
    idle_last = [20, 20, 20, 20, 20, 20, 8, 0]  # 64 tokens of 2 experts: a fair share of 16
    found = feed(HealthMonitor(AlertRules()), [loads(idle_last)] * 4 + [loads(BALANCED)] + [loads(idle_last)] * 5)
    assert [(a.kind, a.name, a.step) for a in found] == [("dead_expert", "r#7", 9)]
    assert "no token at 5 samples in a row" in found[0].message
    few = [3, 3, 3, 3, 3, 3, 6, 0]  # 12 tokens: a fair share of 3 is too few to tell an idle expert from chance
    assert feed(HealthMonitor(AlertRules()), [loads(few)] * 12) == []


def test_router_z_and_entropy_wait_for_the_loss_to_turn():
    """As the attention rules: a router that learns sharpens its logits; judged once the loss has turned."""
    sharpening = [loads(BALANCED, entropy=2.0 * 0.7 ** k, z=2.0 + 0.8 * k) for k in range(14)]
    assert feed(HealthMonitor(AlertRules()), sharpening, loss=(False, "the loss is at its lowest", 0)) == []
    found = feed(HealthMonitor(AlertRules()), sharpening, loss=(True, "the loss gave back 7%", 0))
    assert sorted((a.kind, a.name) for a in found) == [("router_z_growth", "r"), ("routing_entropy_collapse", "r")]
    assert all(a.message.endswith("; meanwhile the loss gave back 7%") for a in found)
    assert "AlertRules.router_z_growth is 5" in next(a.message for a in found if a.kind == "router_z_growth")


@pytest.mark.parametrize("bad, message", [
    (dict(router_collapse=0), "AlertRules.router_collapse must be a number in (0, 1], got 0"),
    (dict(router_collapse=1.5), "AlertRules.router_collapse must be a number in (0, 1], got 1.5"),
    (dict(router_collapse_growth=1), "AlertRules.router_collapse_growth must be a number > 1, got 1"),
    (dict(router_z_growth=float("inf")), "AlertRules.router_z_growth must be a finite number > 0, got inf"),
    (dict(router_z_growth="5"), "AlertRules.router_z_growth must be a finite number > 0, got '5'"),
    (dict(router_entropy_collapse=True), "AlertRules.router_entropy_collapse must be a number in (0, 1], got True"),
])
def test_bad_router_rules_name_the_value(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        AlertRules(**bad)


# ---------------------------------------------------------------------- real routers


def moe(kind: str, router_std: Optional[float] = None) -> nn.Module:
    """A tiny causal LM of ``kind``: 2 layers, ``EXPERTS`` experts, top-2, built from its config."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                  num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "Mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=64, num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS))
    elif kind == "Qwen2-MoE":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=64, num_key_value_heads=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=EXPERTS))
    elif kind == "Qwen3-MoE":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=64, num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=EXPERTS))
    elif kind == "OLMoE":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, intermediate_size=32, num_key_value_heads=4, num_experts=EXPERTS))
    elif kind == "DeepSeek-V3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, intermediate_size=64, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=EXPERTS,
            n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))
    else:
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, intermediate_size=32, num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS,
            layer_types=["full_attention"] * 2))
    if router_std is not None:  # routers sure of themselves from the start
        for layer in model.model.layers:
            nn.init.normal_(layer.mlp.router.weight if kind == "gpt-oss" else layer.mlp.gate.weight, std=router_std)
    return model


def steer(router: nn.Module, expert: int, offset: float, start: int) -> Callable[[int], None]:
    """From step ``start`` on, ``offset`` added to ``expert``'s logit of a transformers v5 router
    (one that returns its logits, scores and indices): the routing recomputed from the new logits
    as the router does (softmax, top-k, renormalized). Returns what tells it the step."""
    step = [0]

    def hook(module: nn.Module, args: tuple, output: tuple) -> Optional[tuple]:
        if step[0] < start:
            return None
        logits = output[0] + offset * nn.functional.one_hot(torch.tensor(expert), output[0].shape[-1])
        top, indices = logits.float().softmax(-1).topk(module.top_k, dim=-1)
        return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), indices

    router.register_forward_hook(hook)
    return lambda k: step.__setitem__(0, k)


def train(log_dir, model: nn.Module, *, steps: int = 40, every: int = 1, lr: float = 1e-3, with_loss: bool = True,
          tell: Callable[[int], None] = lambda k: None, families: tuple[str, ...] = ("moe",),
          losses: Optional[list] = None) -> list:
    """``steps`` AdamW steps of next-token prediction on counting sequences (each token the one
    before plus one, from a random start: learnable), measured every ``every`` steps (the ``moe``
    family alone, unless ``families``); the alerts. ``with_loss=False``: the growth rules judge at
    every sample. ``losses``: each step's loss appended."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from more; on shared cores they wait on each other
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Inspector(model, log_dir=log_dir, every_n_steps=every, optimizer=opt, families=families) as inspector:
                for k in range(steps):
                    tell(k)
                    ids = (torch.randint(0, VOCAB, (BATCH, 1), generator=generator) + torch.arange(SEQ)) % VOCAB
                    loss = model(ids, labels=ids).loss
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    inspector.step(loss=loss if with_loss else None)
                    if losses is not None:
                        losses.append(float(loss))
    finally:
        torch.set_num_threads(threads)
    return inspector.alerts


FAMILIES = [("Mixtral", 1), ("Qwen2-MoE", 2), ("Qwen3-MoE", 1), ("OLMoE", 2), ("DeepSeek-V3", 1), ("gpt-oss", 2)]


@pytest.mark.parametrize("kind, every", FAMILIES)
def test_healthy_moe_training_raises_no_alert(kind, every, tmp_path, events):
    """Every sample judged by every rule, the growth rules too (no loss given: they cannot wait for it to turn)."""
    assert train(tmp_path, moe(kind), every=every, with_loss=False) == []
    tab = tab_values(events(tmp_path))
    router = "router" if kind == "gpt-oss" else "gate"
    entropy = tab[f"moe_entropy/model.layers.1.mlp.{router}"]
    assert len(entropy) == 40 // every and min(entropy.values()) > 1.9  # measured, near log 8 = 2.08


@pytest.mark.parametrize("with_loss", [True, False])
def test_routing_that_sharpens_while_the_loss_falls_raises_no_alert(with_loss, tmp_path, events):
    """Routers sure of themselves (weights of std 1) at a high learning rate: gpt-oss's first
    router's entropy falls from 0.37 to 0.04 nats and its log Z grows from 9 to 15 while the loss
    falls from 4.2 to 0.01. Learning, not failing: the growth rules wait for the loss to turn.
    Without the loss they judge at every sample, and say it."""
    alerts = train(tmp_path, moe("gpt-oss", router_std=1.0), steps=60, lr=1e-2, with_loss=with_loss)
    entropy = tab_values(events(tmp_path))["moe_entropy/model.layers.0.mlp.router"]
    assert min(entropy.values()) < 0.25 * entropy[0]
    if with_loss:
        assert alerts == []
    else:
        assert {a.kind for a in alerts} == {"routing_entropy_collapse", "router_z_growth"}


@pytest.mark.parametrize("every", [1, 2])
def test_an_injected_collapse_is_said_within_two_samples_naming_its_router(every, tmp_path):
    model = moe("Mixtral")
    alerts = train(tmp_path, model, every=every, tell=steer(model.model.layers[0].mlp.gate, 0, 30.0, start=20))
    assert [(a.kind, a.name) for a in alerts] == [("router_collapse", ROUTER)]
    assert 20 < alerts[0].step <= 20 + every  # the second sample of the collapse
    assert f"onto expert {ROUTER}#0: it took 128 of the 128 tokens" in alerts[0].message  # the counts show it


def test_an_injected_collapse_reaches_the_report_and_fails_it(tmp_path, capsys):
    from layerwatch.cli import main
    from layerwatch.reading.notebook import load_alerts

    model = moe("Mixtral")
    train(tmp_path, model, tell=steer(model.model.layers[0].mlp.gate, 0, 30.0, start=20), with_loss=False)
    frame = load_alerts(tmp_path)
    assert set(zip(frame.kind, frame.layer)) == {
        ("router_collapse", ROUTER), ("router_z_growth", ROUTER), ("routing_entropy_collapse", ROUTER)}
    assert main(["report", str(tmp_path), "--fail-on", "router_z_growth"]) == 1
    assert "router_collapse" in capsys.readouterr().out


def test_a_masked_expert_is_dead_within_a_window(tmp_path):
    model = moe("Mixtral")
    alerts = train(tmp_path, model, tell=steer(model.model.layers[0].mlp.gate, 3, -1e9, start=10))
    assert [(a.kind, a.name) for a in alerts] == [("dead_expert", f"{ROUTER}#3")]
    assert alerts[0].step == 10 + AlertRules().window - 1


@pytest.mark.parametrize("kind", [kind for kind, _ in FAMILIES])
def test_healthy_moe_training_at_the_defaults_raises_no_alert_of_any_kind(kind, tmp_path):
    """Every family on (not the moe family alone), the loss given, as a user runs it: none of
    the rules, the routers' or the others (vanishing, dead, exploding, ...), fires on a MoE model
    learning."""
    losses: list = []
    assert train(tmp_path, moe(kind), every=2, families=FAMILY_NAMES, losses=losses) == []
    assert losses[-1] < math.log(VOCAB) - 1  # it learned, and nothing was said
