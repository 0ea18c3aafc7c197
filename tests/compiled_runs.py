"""The compiled Llama of tests/engine/test_compiled_transformers.py (and, on CUDA, tests/test_gpu.py):
transformers' ``LlamaForCausalLM`` at a small size, compiled and computing in bfloat16, trained
through each front door with and without layerwatch, and the checks that the two runs are the
same. Importing it skips the test file or test that imports it without transformers, Lightning
or Dynamo."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")
dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

STEPS = 4  # the defaults sample steps 0 and 1 (the Trainer's 1 and 2)
VOCAB, SEQ = 256, 32


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=SEQ,
                                      attention_dropout=0.1)
    return transformers.LlamaForCausalLM(config)


def token_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(STEPS)]


def fresh_counts() -> None:
    dynamo.reset()
    counters.clear()


def dynamo_counts() -> dict:
    return {"graphs": counters["stats"]["unique_graphs"], "recompiles": sum(counters["recompiles"].values()),
            "graph_breaks": sum(counters["graph_break"].values())}


def training_gaps(watched: dict, plain: dict) -> dict:
    """What tells two runs' training apart, bitwise: the parameters whose final weights differ, the
    steps whose losses differ, and Dynamo's counts (graphs, recompiles, graph breaks) where they do.
    Empty when the runs trained alike."""
    gaps: dict = {}
    weights = [k for k, (a, b) in enumerate(zip(watched["weights"], plain["weights"])) if not torch.equal(a, b)]
    losses = [k for k, (a, b) in enumerate(zip(watched["losses"], plain["losses"])) if a != b]
    if weights:
        gaps["final weights of parameters"] = weights
    if losses:
        gaps["losses at steps"] = losses
    if watched["dynamo"] != plain["dynamo"]:
        gaps["dynamo counts"] = (watched["dynamo"], plain["dynamo"])
    return gaps


MEASURED = ("activations_norm/model.layers.0.self_attn.q_proj", "activations_norm/model.layers.1.mlp",
            "activations_norm/lm_head", "attention_logit_max/model.layers.0.self_attn",
            "attention_entropy/model.layers.1.self_attn", "logsumexp_mean/lm_head")  # the re-run's families


def sampled_steps(acc, prefix: str = "") -> dict[str, list[int]]:
    """The steps each tag of :data:`MEASURED` was written at (``prefix``: the model's own name
    before its modules', as a LightningModule holding it spells them)."""
    return {tag: [e.step for e in acc.Scalars(tag.replace("/", f"/{prefix}", 1))] for tag in MEASURED}


def inspector_run(log_dir, device="cpu", mode=None, make=llama) -> dict:
    """AdamW steps of the compiled Llama (or the model ``make()`` builds; ``torch.compile(model,
    mode=mode)``) under ``torch.autocast`` in bfloat16, the Inspector at its defaults when there
    is a ``log_dir``."""
    from layerwatch import Inspector
    from models import train_step

    fresh_counts()
    model = make().to(device)
    compiled = torch.compile(model, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inspector = None if log_dir is None else Inspector(compiled, log_dir=log_dir, optimizer=opt).start()

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            return compiled(input_ids=x, labels=x).loss

    losses = [train_step(lambda x=x.to(device): loss_of(x), opt, inspector) for x in token_batches()]
    if inspector is not None:
        inspector.finish()
    return {"losses": losses, "weights": [p.detach().cpu().clone() for p in model.parameters()], "dynamo": dynamo_counts()}


def trainer_run(callbacks, out, device="cpu") -> dict:
    """The Hugging Face Trainer with ``torch_compile=True, bf16=True`` on the Llama."""
    from hf_models import Tokens

    fresh_counts()
    model = llama()
    args = transformers.TrainingArguments(
        str(out), max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1, save_strategy="no",
        use_cpu=device == "cpu", seed=0, disable_tqdm=True, report_to=["tensorboard"], torch_compile=True, bf16=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    return {"losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],  # as it logs them
            "weights": [p.detach().cpu().clone() for p in model.parameters()], "dynamo": dynamo_counts()}


def lightning_run(callbacks, out, device="cpu") -> dict:
    """Lightning's Trainer with ``precision="bf16-mixed"`` on the compiled :class:`LitLlama`."""
    from models import make_trainer

    fresh_counts()
    module = LitLlama()
    trainer = make_trainer(out, callbacks, max_steps=STEPS, precision="bf16-mixed", accelerator=device)
    trainer.fit(torch.compile(module))
    return {"losses": module.losses, "weights": [p.detach().cpu().clone() for p in module.parameters()],
            "dynamo": dynamo_counts()}


class LitLlama(L.LightningModule):
    """Llama trained on :func:`token_batches`, its steps' losses kept exact."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = llama()
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=x, labels=x).loss

    def training_step(self, batch, batch_idx):
        return self(batch)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())

    def train_dataloader(self):
        torch.manual_seed(2)
        return torch.utils.data.DataLoader(token_batches(), batch_size=None)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
