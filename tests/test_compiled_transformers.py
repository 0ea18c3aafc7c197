"""A compiled real model trains the same with layerwatch at its defaults, on every front door.

transformers' GPT-2 at its smallest (2 blocks of width 64, dropout 0.1 as GPT-2 ships), under
``torch.compile`` with Inductor: the plain loop's ``Inspector``, Lightning's callback on a
compiled LightningModule, and the Hugging Face callback under ``torch_compile=True``. Each
run against the same run without layerwatch: the losses and the final weights bitwise equal
(the sampled steps' dropout masks are the unsampled steps' draws), the compiled graphs at most
the user's plus one armed variant of each, none compiled after the first unsampled step, and
the sampled steps measured inside the graph.

Before the armed hooks stopped registering tensor hooks, the armed forward of this model fell
back to running module by module (11 graphs, not 2; see ``probes/traced.py``). Deterministic
algorithms are on: Inductor's CPU code adds some gradients atomically, so without them two runs
without layerwatch can differ in the last bits (``benchmarks/compiled_gpt2.py`` shows it).
"""

import argparse

import pytest
import torch

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")
dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

STEPS = 4  # the defaults sample steps 0 and 1; 2 compiles the unarmed graph, 3 must compile nothing
VOCAB, SEQ = 256, 32


def gpt2() -> torch.nn.Module:
    from compiled_gpt2 import gpt2 as build

    torch.manual_seed(0)
    model = build(layers=2, d=64, heads=2, vocab=VOCAB, seq=SEQ)
    assert model.config.resid_pdrop == model.config.embd_pdrop == model.config.attn_pdrop == 0.1
    return model


def token_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(STEPS)]


@pytest.fixture(autouse=True)
def deterministic(benchmarks):
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)
    dynamo.reset()


def dynamo_counts() -> dict:
    from compiled_gpt2 import dynamo_counts

    return dynamo_counts()


def fresh_counts() -> None:
    dynamo.reset()
    counters.clear()


def compiled_at(graphs_after_each_step: list[int]) -> list[int]:
    return [k for k, (before, after) in enumerate(zip([0] + graphs_after_each_step, graphs_after_each_step)) if after > before]


def same_training(watched: dict, plain: dict) -> None:
    differing = [k for k, (a, b) in enumerate(zip(watched["weights"], plain["weights"])) if not torch.equal(a, b)]
    assert not differing, f"final weights differ: parameters {differing}"  # bitwise (checked first: the training result)
    steps = [k for k, (a, b) in enumerate(zip(watched["losses"], plain["losses"])) if a != b]
    assert not steps, f"losses differ at steps {steps}: {watched['losses']} != {plain['losses']}"  # bitwise
    graphs, plain_graphs = watched["dynamo"].pop("graphs"), plain["dynamo"].pop("graphs")
    assert plain_graphs < graphs <= 2 * plain_graphs, (graphs, plain_graphs)  # the user's, and one armed variant
    assert watched["dynamo"] == plain["dynamo"]  # no recompile, no graph break more
    assert max(watched["compiled_at"]) <= 2  # the first unsampled step compiles the user's graph; no later step compiles


def measured_inside(acc, sampled=(0, 1), prefix="") -> None:
    for name in ("transformer.h.0.attn.c_attn", "transformer.h.1.mlp", "lm_head"):
        assert [e.step for e in acc.Scalars(f"activations_norm/{prefix}{name}")] == list(sampled), name
    # the transformer signals, inside the graph too: each block's attention (SDPA's stand-in), the head's log Z
    for tag in (f"attention_logit_max/{prefix}transformer.h.0.attn", f"attention_entropy/{prefix}transformer.h.1.attn",
                f"logsumexp_mean/{prefix}lm_head"):
        assert [e.step for e in acc.Scalars(tag)] == list(sampled), tag


def plain_loop(log_dir=None, device="cpu") -> dict:
    """The benchmark's loop (``benchmarks/compiled_gpt2.py``) at this size: AdamW steps of the
    compiled model, with the Inspector at its defaults when there is a ``log_dir``."""
    from compiled_gpt2 import one_run

    args = argparse.Namespace(layers=2, d=64, heads=2, vocab=VOCAB, seq=SEQ, batch=2, steps=STEPS, backend="inductor",
                              device=device, dropout=0.1)
    run = one_run(log_dir is not None, args, None if log_dir is None else str(log_dir))
    return {"losses": run["losses"], "weights": run["weights"], "compiled_at": run["compiled_at"],
            "dynamo": {key: run[key] for key in ("graphs", "recompiles", "graph_breaks")}}


def test_the_inspector_on_a_compiled_gpt2_leaves_its_run_as_it_was(tmp_path, events):
    plain = plain_loop()
    watched = plain_loop(tmp_path)
    same_training(watched, plain)
    measured_inside(events(tmp_path))


def test_the_hugging_face_callback_under_torch_compile_leaves_the_run_as_it_was(tmp_path, events):
    from layerwatch.huggingface import InspectTrainerCallback
    from test_huggingface import Tokens, event_dirs

    def trained(callbacks, out) -> dict:
        fresh_counts()
        model = gpt2()
        graphs = []

        class AfterStep(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                graphs.append(counters["stats"]["unique_graphs"])

        args = transformers.TrainingArguments(
            str(out), max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1, save_strategy="no", use_cpu=True,
            seed=0, disable_tqdm=True, report_to=["tensorboard"], torch_compile=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[*callbacks, AfterStep()])
        trainer.train()
        return {"losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
                "weights": [p.detach().clone() for p in model.parameters()], "dynamo": dynamo_counts(),
                "compiled_at": compiled_at(graphs)}

    plain = trained([], tmp_path / "plain")
    watched = trained([InspectTrainerCallback()], tmp_path / "watched")
    same_training(watched, plain)
    (run,) = event_dirs(tmp_path / "watched")
    measured_inside(events(run), sampled=(1, 2))  # the Trainer counts steps from 1


def test_lightnings_callback_on_a_compiled_module_leaves_the_run_as_it_was(tmp_path, events):
    from layerwatch import InspectCallback
    from models import make_trainer

    def trained(callbacks, out) -> dict:
        fresh_counts()
        module = LitGPT2()
        trainer = make_trainer(out, [*callbacks, GraphsAfterStep()], max_steps=STEPS)
        trainer.fit(torch.compile(module))
        return {"losses": module.losses, "weights": [p.detach().clone() for p in module.parameters()],
                "dynamo": dynamo_counts(), "compiled_at": compiled_at(trainer.callbacks[-1].graphs)}

    plain = trained([], tmp_path / "plain")
    watched = trained([InspectCallback()], tmp_path / "watched")
    same_training(watched, plain)
    measured_inside(events(tmp_path / "watched" / "tb" / "version_0"), prefix="gpt2.")


class LitGPT2(L.LightningModule):
    """GPT-2 trained on :func:`token_batches`, its steps' losses kept exact."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt2 = gpt2()
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=x, labels=x).loss

    def training_step(self, batch, batch_idx):
        return self(batch)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())  # the step's (the callback may run a batch again for the table)

    def train_dataloader(self):
        torch.manual_seed(2)
        return torch.utils.data.DataLoader(token_batches(), batch_size=None)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class GraphsAfterStep(L.Callback):
    def __init__(self) -> None:
        self.graphs: list[int] = []

    def on_train_batch_end(self, *args) -> None:
        self.graphs.append(counters["stats"]["unique_graphs"])
