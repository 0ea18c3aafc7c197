"""The Hugging Face Trainer front door: tiny models built from configs in code (nothing is
downloaded), trained on CPU with and without the callback."""

import gc
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_models import VOCAB, Tokens, event_dirs, tiny, train  # noqa: E402
from layerwatch.huggingface import InspectTrainerCallback  # noqa: E402
from models import hook_count, layerwatch_messages, same_tensors, scripted_ideal, tab_values  # noqa: E402


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_same_losses_and_weights_one_run_and_no_hook_left(kind, tmp_path, events):
    plain_model = tiny(kind)
    _, plain = train(plain_model, tmp_path / "plain", gradient_accumulation_steps=2)
    model = tiny(kind)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer, watched = train(model, tmp_path / "watched", [InspectTrainerCallback(every_n_steps=2)],
                                 gradient_accumulation_steps=2)
    assert watched == plain  # bitwise
    assert all(torch.equal(a, b) for a, b in zip(plain_model.state_dict().values(), model.state_dict().values()))
    assert hook_count(model, trainer.optimizer.optimizer) == 0
    assert not layerwatch_messages(seen)
    (run,) = event_dirs(tmp_path / "watched")  # HF's writer reused: one run
    acc = events(run)
    scalars = set(acc.Tags()["scalars"])
    assert "train/loss" in scalars and "layerwatch/grad_norm" in scalars
    # optimizer steps 1..6 (accumulation counts only them); k is where HF logs that batch's loss
    assert [e.step for e in acc.Scalars("layerwatch/grad_norm")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    name = next(t for t in scalars if t.startswith("update_ratio/"))
    assert [e.step for e in acc.Scalars(name)] == [2, 4, 6]
    assert any(t.startswith("fwd_ms/") for t in scalars)


def test_the_default_overhead_budget_samples_hfs_first_two_steps_then_multiples(tmp_path, events, monkeypatch):
    from layerwatch.engine.budget import Pacer

    monkeypatch.setattr(Pacer, "ideal", scripted_ideal(lambda: 3.0))  # every 5 steps
    train(tiny("gpt2"), tmp_path, [InspectTrainerCallback()], max_steps=11)
    (run,) = event_dirs(tmp_path)
    logged = {e.step: e.value for e in events(run).Scalars("layerwatch/sample_interval")}
    assert logged == {1: 1, 2: 5, 5: 5, 10: 5}  # HF's steps start at 1


def test_gradients_are_read_after_hfs_clipping(tmp_path, events):
    trainer, _ = train(tiny("gpt2"), tmp_path, [InspectTrainerCallback(every_n_steps=1)], max_grad_norm=0.01)
    (run,) = event_dirs(tmp_path)
    norms = [e.value for e in events(run).Scalars("layerwatch/grad_norm")]
    assert len(norms) == 6 and max(norms) <= 0.01 * (1 + 1e-4)


def test_without_tensorboard_callback_it_writes_its_own_run_and_says_where(tmp_path, events, capsys):
    callback = InspectTrainerCallback(every_n_steps=3)
    train(tiny("gpt2"), tmp_path, [callback], report_to=())
    assert callback.log_dir == str(tmp_path / "runs" / "layerwatch")
    assert str(tmp_path / "runs" / "layerwatch") in capsys.readouterr().out
    assert [e.step for e in events(callback.log_dir).Scalars("layerwatch/grad_norm")] == [3, 6]


class Adapted(nn.Module):
    """A frozen base with zero biases and trainable low-rank adapters (B starts at zero), as
    PEFT's LoRA builds it, around a tiny GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        self.base = tiny("gpt2")
        self.base.requires_grad_(False)
        for block in self.base.transformer.h:
            nn.init.zeros_(block.mlp.c_fc.bias)
        self.lora_A = nn.Linear(64, 4, bias=False)
        self.lora_B = nn.Linear(4, 64, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, input_ids, labels):
        embeds = self.base.transformer.wte(input_ids)
        embeds = embeds + self.lora_B(self.lora_A(embeds))
        return self.base(inputs_embeds=embeds, labels=labels)


def test_a_frozen_base_with_adapters_raises_no_alert_and_watches_the_adapters(tmp_path, events):
    callback = InspectTrainerCallback(every_n_steps=1)
    train(Adapted(), tmp_path, [callback], max_steps=8, learning_rate=1e-2)
    assert callback.alerts == []
    (run,) = event_dirs(tmp_path)
    acc = events(run)
    scalars = set(acc.Tags()["scalars"])
    assert {"grads_norm/lora_A.weight", "grads_norm/lora_B.weight", "update_ratio/lora_B.weight"} <= scalars
    assert "weights_norm/base.transformer.h.0.mlp.c_fc.bias" in scalars  # frozen: weights, no gradient
    assert not any(t.startswith("grads_norm/base.") for t in scalars)
    assert [e.value for e in acc.Scalars("layerwatch/params_frozen")][0] > 0


@pytest.mark.parametrize("then", ["drop the trainer", "train again"])
def test_a_forward_that_raises_on_a_sampled_step_leaves_no_hook(tmp_path, then):
    model = tiny("gpt2")
    calls = []

    def users_bug(module, args):
        calls.append(1)
        if len(calls) == 4:  # the 4th optimizer step's forward, sampled: every probe is armed
            raise RuntimeError("a shape bug")

    bug = model.transformer.h[1].register_forward_pre_hook(users_bug)
    args = transformers.TrainingArguments(str(tmp_path), max_steps=6, per_device_train_batch_size=4, save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, report_to=["tensorboard"])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=[InspectTrainerCallback(every_n_steps=1)])
    with pytest.raises(RuntimeError, match="a shape bug"):
        trainer.train()
    optimizer = trainer.optimizer.optimizer
    assert hook_count(model, optimizer) == 1 and "forward" not in vars(model)  # at once: the user's own hook only
    if then == "train again":
        trainer.train()  # the hook has fired its error; this run completes
        assert hook_count(model, optimizer) == 1  # the user's own hook only
    else:
        del trainer
        gc.collect()
        assert hook_count(model, optimizer) == 1
    bug.remove()
    assert hook_count(model, optimizer) == 0


def test_importing_layerwatch_does_not_import_transformers():
    code = "import sys, layerwatch; assert 'transformers' not in sys.modules; import layerwatch.huggingface"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _ddp_rank(rank: int, world: int, out: str) -> None:
    """One rank of a 2-process CPU DDP run, in the process group HF's distributed launch would make."""
    args = transformers.TrainingArguments(out, max_steps=4, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, report_to=["tensorboard"], max_grad_norm=0)
    trainer = transformers.Trainer(model=tiny("gpt2"), args=args, train_dataset=Tokens(),
                                   callbacks=[InspectTrainerCallback(every_n_steps=2)])
    trainer.train()
    assert torch.distributed.get_world_size() == 2


def test_ddp_on_two_cpu_ranks_rank_zero_writes_the_synchronized_gradients(tmp_path, events):
    from ranks import run_ranks

    run_ranks(_ddp_rank, str(tmp_path / "out"), tmp=tmp_path, debug="INFO")  # DETAIL crashes DDP's constructor (see run_ranks)
    (run,) = event_dirs(tmp_path / "out")  # one run: rank 0's, in HF's writer
    acc = events(run)
    ours = {e.step: e.value for e in acc.Scalars("layerwatch/grad_norm")}
    hfs = {e.step: e.value for e in acc.Scalars("train/grad_norm")}
    assert sorted(ours) == [2, 4]
    for step, value in ours.items():  # the all-reduced gradients, read before the optimizer step
        assert value == pytest.approx(hfs[step], rel=1e-5)


def test_peft_lora_frozen_base_raises_no_alert_and_its_adapters_are_watched(tmp_path, events):
    peft = pytest.importorskip("peft")

    def lora():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
        return peft.get_peft_model(tiny("gpt2"), config)

    _, plain = train(lora(), tmp_path / "plain", max_steps=8)
    callback = InspectTrainerCallback(every_n_steps=1)
    _, watched = train(lora(), tmp_path / "watched", [callback], max_steps=8)
    assert watched == plain
    assert callback.alerts == []
    (run,) = event_dirs(tmp_path / "watched")
    scalars = set(events(run).Tags()["scalars"])
    adapters = [t for t in scalars if t.startswith("grads_norm/") and "lora_" in t]
    assert adapters and all(".lora_A." in t or ".lora_B." in t for t in adapters)
    assert not [t for t in scalars if t.startswith("grads_norm/") and "lora_" not in t]  # the base is frozen
    assert any(t.startswith("weights_norm/") and "c_attn.base_layer.bias" in t for t in scalars)
    assert any(t.startswith("update_ratio/") and "lora_B" in t for t in scalars)


def test_without_transformers_the_adapter_says_what_to_install():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import layerwatch.huggingface\nexcept ImportError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "layerwatch[huggingface]"' in out.stdout, out.stdout + out.stderr


def test_torch_compile_true_is_measured_on_its_re_runs_with_bitwise_losses(tmp_path, events):
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the model; the callback, told
    by ``args``, hooks none of its modules, and its pre-hook on the module the Trainer calls keeps
    each sampled step's inputs, run again eagerly before the step's own forward."""
    dynamo = pytest.importorskip("torch._dynamo")
    settings = dict(torch_compile=True, torch_compile_backend="aot_eager")
    dynamo.reset()
    plain_model = tiny("gpt2")
    _, plain = train(plain_model, tmp_path / "plain", **settings)
    dynamo.reset()
    model = tiny("gpt2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer, watched = train(model, tmp_path / "watched", [InspectTrainerCallback(every_n_steps=2)], **settings)
    assert watched == plain  # bitwise
    assert all(torch.equal(a, b) for a, b in zip(plain_model.state_dict().values(), model.state_dict().values()))
    assert hook_count(model, trainer.optimizer.optimizer) == 0
    assert layerwatch_messages(seen) == []
    (run,) = event_dirs(tmp_path / "watched")
    acc = events(run)
    for name in ("(root)", "transformer.wte", "transformer.h.0.mlp", "transformer.h.1.attn", "lm_head"):
        assert [e.step for e in acc.Scalars(f"activations_norm/{name}")] == [2, 4, 6], name
    # the layer table: from the first sample's re-run
    (table,) = acc.Tensors("layerwatch/structure/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert table.step == 2 and "GPT2LMHeadModel" in text and "c_fc (Conv1D)" in text



def test_a_re_run_that_raises_is_said_once_and_leaves_the_compiled_model_as_it_was(tmp_path):
    """A block whose forward raises with autograd off raises in every re-run alone: each is warned
    about once and skipped, training goes on, and the model keeps neither a hook nor a wrapped
    ``forward`` of layerwatch's (a failing re-run is not the user's failing forward)."""
    pytest.importorskip("torch._dynamo").reset()
    model = tiny("gpt2")

    def no_eval(module, args):
        if not torch.is_grad_enabled():
            raise RuntimeError("this block trains only")

    own = model.transformer.h[1].register_forward_pre_hook(no_eval)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer, losses = train(model, tmp_path, [InspectTrainerCallback(every_n_steps=2)], torch_compile=True,
                                torch_compile_backend="aot_eager")
    assert len(losses) == 6
    said = [m for m in layerwatch_messages(seen) if "this block trains only" in m]
    assert len(said) == 1 and "run a micro-batch of the sampled step again" in said[0], said
    assert hook_count(model, trainer.optimizer.optimizer) == 1 and "forward" not in vars(model)
    own.remove()

# ------------------------------------------------------------------------------- faults at the defaults


class NaNAtStep:
    """A fault in ``transformer.h.1.mlp``: one value of its output turns to NaN in the training
    forward of micro-batch ``micro_batch`` of optimizer step ``step`` (on ``rank`` alone, in a
    distributed run). Set by the step and the micro-batch's inputs, not by call, as a fault of
    the data would be: a replay of that step makes it again."""

    def __init__(self, model: nn.Module, step: int = 8, micro_batch: int = 1, rank: int = 0) -> None:
        self.trainer = None
        self.step, self.micro_batch, self.rank = step, micro_batch, rank
        self.inputs: list = []  # the input ids of the step's first micro-batches, as the Trainer passed them
        self.ids = None
        model.register_forward_pre_hook(self.note, with_kwargs=True)
        model.transformer.h[1].mlp.register_forward_hook(self.spoil)

    def _now(self, module: nn.Module) -> bool:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return (module.training and torch.is_grad_enabled() and rank == self.rank
                and self.trainer.state.global_step + 1 == self.step)

    def note(self, module, args, kwargs):
        self.ids = kwargs.get("input_ids")
        if self._now(module) and len(self.inputs) < self.micro_batch:
            self.inputs.append(self.ids)

    def spoil(self, module, args, output):
        if self._now(module) and len(self.inputs) == self.micro_batch and self.ids is self.inputs[-1]:
            output = output.clone()
            output[0, 0, 0] = float("nan")
            return output
        return None


def train_with_fault(out, callbacks=(), *, trainer_class=None, fault=None, **kwargs):
    """``train`` a tiny GPT-2 for 14 steps, without clipping, with a ``NaNAtStep(**fault)``."""
    model = tiny("gpt2")
    spoiler = NaNAtStep(model, **(fault or {}))
    settings = dict(max_steps=14, per_device_train_batch_size=4, logging_steps=1, save_strategy="no", use_cpu=True,
                    seed=0, disable_tqdm=True, report_to=["tensorboard"], max_grad_norm=0)
    settings.update(kwargs)
    trainer = (trainer_class or transformers.Trainer)(
        model=model, args=transformers.TrainingArguments(str(out), **settings), train_dataset=Tokens(),
        callbacks=list(callbacks))
    spoiler.trainer = trainer
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model, losses, layerwatch_messages(seen)


def nonfinite_alerts(callback):
    return [a for a in callback.alerts if a.kind == "nonfinite" and not a.message.startswith("NaN/Inf values")]


@pytest.mark.parametrize("clipping", [0, 1.0], ids=["no clipping", "clipped to 1"])
def test_a_nan_between_samples_is_found_at_its_step_and_replayed_to_its_module(clipping, tmp_path, events):
    """The Trainer clears the gradients before ``on_step_end``: the sentinel checks them before
    the optimizer step, and the replay runs the step's inputs through the model again."""
    plain_model, plain, _ = train_with_fault(tmp_path / "plain", max_grad_norm=clipping)
    callback = InspectTrainerCallback()  # the defaults: samples at 1 and 2, then every 200 steps
    model, watched, said = train_with_fault(tmp_path / "watched", [callback], max_grad_norm=clipping)
    assert watched == plain  # bitwise (HF logs a NaN loss as the mean of the earlier ones)
    assert same_tensors(list(plain_model.state_dict().values()), list(model.state_dict().values()))
    (sentinel,) = [m for m in said if "the sentinel" in m]
    assert "NaN/Inf gradients at step 8" in sentinel and "its batch is run again with every probe armed" in sentinel
    (alert,) = nonfinite_alerts(callback)
    assert (alert.step, alert.name) == (8, "transformer.h.1.mlp")
    assert alert.message == ("first offender: step 8, forward: transformer.h.1.mlp turned finite inputs into a non-finite "
                             "output (replayed from step 8)")
    (run,) = event_dirs(tmp_path / "watched")
    acc = events(run)
    assert [(e.step, e.value) for e in acc.Scalars("layerwatch/first_nonfinite_step")] == [(8, 8.0)]
    assert [e.step for e in acc.Tensors("layerwatch/first_offender/text_summary")] == [8]
    assert hook_count(model) == 2  # the fault's own two hooks: the door's input hook is gone


def test_with_gradient_accumulation_the_micro_batch_that_made_it_is_named(tmp_path):
    callback = InspectTrainerCallback()
    train_with_fault(tmp_path, [callback], fault=dict(micro_batch=2), gradient_accumulation_steps=2, max_steps=10)
    (alert,) = nonfinite_alerts(callback)
    assert (alert.step, alert.name) == (8, "transformer.h.1.mlp")
    assert alert.message.endswith("(replayed from step 8, micro-batch 2 of 2)")


def test_without_the_sentinel_a_sample_after_the_fault_names_no_first_offender(tmp_path, events):
    """The weights are NaN from step 8 on: at the sample at step 10, ``transformer.wte`` turns
    finite token ids into NaN with a NaN weight. It used the fault; it did not make it."""
    callback = InspectTrainerCallback(every_n_steps=5, sentinel=False)
    train_with_fault(tmp_path, [callback], max_steps=10)
    (alert,) = nonfinite_alerts(callback)
    assert (alert.step, alert.name) == (10, "transformer.wte")
    assert alert.message.startswith("first module to use a non-finite weight at step 10: transformer.wte "
                                    "(transformer.wte.weight, ")
    assert "The fault happened before step 10, where no probe saw it" in alert.message
    assert "the sentinel is off; with sentinel=True it is found at its step" in alert.message
    assert not any("first offender" in a.message for a in callback.alerts)
    (run,) = event_dirs(tmp_path)
    assert "layerwatch/first_offender/text_summary" not in events(run).Tags()["tensors"]


class LossTrainer(transformers.Trainer):
    """A loss of its own: the model's, times a factor that is NaN at step 8."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        factor = float("nan") if self.state.global_step + 1 == 8 else 1.0
        loss = outputs.loss * factor
        return (loss, outputs) if return_outputs else loss


def test_a_fault_in_a_compute_loss_of_its_own_is_said_to_be_outside_the_replay(tmp_path):
    callback = InspectTrainerCallback()
    _, _, said = train_with_fault(tmp_path, [callback], trainer_class=LossTrainer, fault=dict(step=100), max_steps=10)
    (alert,) = nonfinite_alerts(callback)  # the next step's sample: what came after it
    assert alert.step == 9 and alert.message.startswith("first module to use a non-finite weight at step 9: ")
    assert alert.message.endswith("(step 8's batch, run again, made no NaN/Inf)")
    (replay,) = [m for m in said if "made no NaN/Inf (" in m]
    assert replay == (
        "layerwatch: step 8's batch, run again with every probe armed, made no NaN/Inf (the fault is outside what the "
        "replay runs, or does not happen again; the replay backpropagates the model's own loss (outputs.loss), not "
        "LossTrainer.compute_loss's, so a fault in that loss is not run again); the next step is sampled instead")


def test_a_loss_computed_outside_the_model_is_said_to_leave_no_replay(tmp_path):
    def cross_entropy(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
        return nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))

    callback = InspectTrainerCallback()
    model = tiny("gpt2")
    spoiler = NaNAtStep(model)
    args = transformers.TrainingArguments(str(tmp_path), max_steps=10, per_device_train_batch_size=4, save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, report_to=[], max_grad_norm=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback],
                                   compute_loss_func=cross_entropy)
    spoiler.trainer = trainer
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    (sentinel,) = [m for m in layerwatch_messages(seen) if "the sentinel" in m]
    assert "NaN/Inf gradients at step 8" in sentinel
    assert ("the Trainer computes the loss outside the model (compute_loss_func), so a replay of the model has no loss "
            "to run the backward of; the bad step is not replayed") in sentinel
    assert not any("first offender" in a.message for a in callback.alerts)


def _ddp_fault_rank(rank: int, world: int, out: str) -> None:
    """One rank of a 2-process CPU DDP run whose fault is in rank 1's batch of step 3."""
    model = tiny("gpt2")
    spoiler = NaNAtStep(model, step=3, rank=1)
    args = transformers.TrainingArguments(out, max_steps=5, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, report_to=["tensorboard"], max_grad_norm=0)
    callback = InspectTrainerCallback(every_n_steps=100)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    spoiler.trainer = trainer
    trainer.train()
    if rank == 0:
        (alert,) = nonfinite_alerts(callback)
        assert (alert.step, alert.name) == (3, "transformer.h.1.mlp"), alert
        assert alert.message.endswith("(replayed from step 3, rank 1's batch)"), alert.message


def test_under_ddp_the_rank_whose_batch_made_it_is_named(tmp_path, events):
    from ranks import run_ranks

    run_ranks(_ddp_fault_rank, str(tmp_path / "out"), tmp=tmp_path, debug="INFO")  # DETAIL crashes DDP's constructor
    (run,) = event_dirs(tmp_path / "out")
    acc = events(run)
    assert [(e.step, e.value) for e in acc.Scalars("layerwatch/first_nonfinite_step")] == [(3, 3.0)]


def test_saved_bytes_of_an_accumulated_step_are_each_micro_batchs_added_up(tmp_path, events):
    """Each micro-batch's forward saves its own tensors for backward; storages freed after one
    micro-batch's backward are given to the next at the same addresses, which must not hide them."""
    saved = {}
    for accumulation in (1, 2):
        train(tiny("gpt2"), tmp_path / str(accumulation), [InspectTrainerCallback(every_n_steps=2)], max_steps=2,
              gradient_accumulation_steps=accumulation)
        (run,) = event_dirs(tmp_path / str(accumulation))
        tab = tab_values(events(run))
        saved[accumulation] = {key: values[2] for key, values in tab.items() if key.startswith("saved_bytes/")}
    assert saved[1] and set(saved[2]) == set(saved[1])
    assert all(saved[2][key] == 2 * value for key, value in saved[1].items()), saved


@pytest.mark.parametrize("router_logits", [False, True])
def test_an_moe_model_gets_its_routers_with_output_router_logits_on_and_off(router_logits, tmp_path):
    """The routers are found on the model, whatever the loss asks of them: with
    ``output_router_logits`` the load-balancing loss is in the loss, and nothing changes for
    layerwatch; each sampled step's tokens are the batches' (4 x SEQ tokens, top-2), and training
    is bitwise the same as without the callback."""
    import layerwatch
    from hf_models import SEQ, tiny_moe

    losses = {}
    for watched in (False, True):
        model = tiny_moe("qwen3_moe", vocab=VOCAB)
        model.config.output_router_logits = router_logits
        callbacks = [InspectTrainerCallback(every_n_steps=2)] if watched else []
        _, losses[watched] = train(model, tmp_path / str(watched), callbacks, max_steps=4)
    assert losses[True] == losses[False]
    frame = layerwatch.load(tmp_path / "True")
    tokens = frame[frame.series == "moe_tokens"]
    assert sorted(tokens.step.unique()) == [2, 4]
    assert tokens.groupby(["step", tokens.layer.str.rpartition("#")[0]]).value.sum().unique().tolist() == [4 * SEQ * 2]
    assert {"moe_entropy", "moe_router_z", "moe_imbalance"} <= set(frame.series)
