"""The Hugging Face Trainer's tiny models, built from configs in code (nothing is downloaded),
their token data set and their training on CPU. Importing this module skips the test file or
test that imports it where transformers or accelerate is not installed."""

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ = 128, 16


class Tokens(Dataset):
    def __init__(self, n: int = 64) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=128, max_position_embeddings=32)
        return transformers.BertForMaskedLM(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def train(model, out, callbacks=(), *, report_to=("tensorboard",), **kwargs):
    settings = dict(max_steps=6, per_device_train_batch_size=4, logging_steps=1, save_strategy="no", use_cpu=True,
                    seed=0, disable_tqdm=True, report_to=list(report_to))
    settings.update(kwargs)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(str(out), **settings),
                                   train_dataset=Tokens(), callbacks=list(callbacks))
    trainer.train()
    return trainer, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def event_dirs(root):
    return sorted({p.parent for p in root.rglob("events.out.tfevents.*")})


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def tiny_moe(family: str, experts: int = 4, top_k: int = 2, vocab: int = 64, seed: int = 0) -> nn.Module:
    """A tiny transformers MoE causal LM of ``family`` (MOE_FAMILIES): 2 layers, hidden 32, ``experts`` routed experts."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts_per_tok=top_k)
    T = transformers
    if family == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=experts, **common))
    if family == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(num_experts=experts, moe_intermediate_size=16,
                                                      shared_expert_intermediate_size=16, **common))
    if family == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=16, **common))
    if family == "olmoe":
        return T.OlmoeForCausalLM(T.OlmoeConfig(num_experts=experts, eos_token_id=None, pad_token_id=None, **common))
    if family == "deepseek_v3":
        common.update(num_key_value_heads=4)
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            n_routed_experts=experts, moe_intermediate_size=16, first_k_dense_replace=0, n_group=1, topk_group=1,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common))
    if family == "gpt_oss":
        return T.GptOssForCausalLM(T.GptOssConfig(num_local_experts=experts, layer_types=["full_attention"] * 2, **common))
    raise ValueError(f"unknown MoE family {family!r}")
