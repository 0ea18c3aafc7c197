"""DeepSpeed ZeRO on two CPU ranks (``DS_ACCELERATOR=cpu``, gloo, fp32): in a plain loop and
under the Hugging Face Trainer, training is unchanged (bitwise losses), nothing crashes or
hangs, and what is written is the whole tensors' truth, read from the ranks' partitions. Every
case runs through :func:`ranks.run_ranks` (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, deadlines);
deepspeed is imported in the ranks only."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from ranks import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")

STEPS = 5
CLIP = 1.0  # DeepSpeed's default gradient_clipping: the gradients the optimizer steps with are clipped


def on_gloo() -> None:
    """DeepSpeed on the CPU: its accelerator, and its collectives on gloo alone. DeepSpeed's CPU
    backend would first build a shared-memory all-reduce op of its own (about 30 s on a clean
    machine, a C++ build in each fresh CI); a GPU run has no such op, and gloo is what
    ``TORCH_DISTRIBUTED_DEBUG`` checks. Called in each rank before DeepSpeed starts."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (deepspeed.comm.torch: torch itself)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Sequential(nn.Linear(64, 64), nn.Tanh()), nn.Linear(64, 1))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]


def reference(world: int) -> dict[int, dict[str, dict[str, float]]]:
    """What two DeepSpeed ranks train, in one process: the mean of the ranks' losses (their
    averaged gradient), clipped as DeepSpeed clips, stepped by SGD. Per step: the weights' norms
    after it, the gradients' norms, and the update ratios."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [batches(rank) for rank in range(world)]
    truth = {}
    for step in range(STEPS):
        opt.zero_grad()
        (sum(nn.functional.mse_loss(model(data[r][step][0]), data[r][step][1]) for r in range(world)) / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads = {n: p.grad.norm().item() for n, p in model.named_parameters()}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        truth[step] = {
            "weights_norm": {n: p.norm().item() for n, p in model.named_parameters()},
            "grads_norm": grads,
            "update_ratio": {n: ((p - before[n]).norm() / p.norm()).item() for n, p in model.named_parameters()},
        }
    return truth


def zero_config(stage: int, persistence: bool = True) -> dict:
    zero = {"stage": stage}
    if not persistence:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter released after its module's forward
    return {"train_micro_batch_size_per_gpu": 8, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "gradient_clipping": CLIP}


def zero_worker(rank: int, world: int, out: str, stage: int, persistence: bool, watch: str, nan_at: int,
                compiled: bool = False, also: tuple[str, ...] = ()) -> None:
    """Train ``mlp()`` under DeepSpeed, without and with an Inspector (``watch``: of the engine, of
    its module with ``optimizer=engine.optimizer``, with the client optimizer (the one given to
    ``deepspeed.initialize``), with another optimizer, or of its module alone), every 2 steps; then
    once more for each watch in ``also``, logged to ``run-<watch>``, its results under its name.
    With a NaN in rank 1's input at ``nan_at``, and (ZeRO-3) a ``GatheredParameters`` block after
    each step, as a checkpoint save makes; with ``compiled``, the engine compiled
    (``engine.compile``, ``aot_eager``). Rank 0 records the losses, its alerts, what it said and
    Dynamo's counts."""
    on_gloo()
    import deepspeed
    from torch._dynamo.utils import counters

    results = {}
    for key, watching, log_dir in ((False, None, None), (True, watch, f"{out}/run"),
                                   *((name, name, f"{out}/run-{name}") for name in also)):
        torch._dynamo.reset()
        counters.clear()
        model = mlp()
        client = torch.optim.SGD(model.parameters(), lr=0.05)
        engine, zero_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=zero_config(stage, persistence))
        if compiled:
            engine.compile(backend="aot_eager")
        inspector = None
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if watching is not None:
                from layerwatch import Inspector

                target, optimizer = {
                    "engine": lambda: (engine, None), "module": lambda: (engine.module, zero_optimizer),
                    "module-client": lambda: (engine.module, client),
                    "module-other": lambda: (engine.module, torch.optim.SGD(engine.module.parameters(), lr=0.05)),
                    "engine-other": lambda: (engine, torch.optim.SGD(engine.module.parameters(), lr=0.05)),
                    "module-alone": lambda: (engine.module, None)}[watching]()
                inspector = Inspector(target, log_dir=log_dir, every_n_steps=2, optimizer=optimizer).start()
            losses = []
            for step, (x, y) in enumerate(batches(rank)):
                if step == nan_at and rank == 1:
                    x = x.clone()
                    x[0, 0] = float("nan")
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if inspector is not None:
                    inspector.step()
                if stage == 3:
                    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                        assert sum(p.numel() for p in engine.module.parameters()) == 5313
            if inspector is not None:
                inspector.finish()
        results[key] = {"losses": losses, "said": [str(w.message) for w in seen if "layerwatch" in str(w.message)],
                        "alerts": [] if inspector is None else [[a.step, a.kind, a.name, a.message] for a in inspector.alerts],
                        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.module.modules()),
                        "dynamo": [counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
                                   sum(counters["recompiles"].values())]}
    if rank == 0:
        Path(out, "results.json").write_text(json.dumps(results))


def check_truth(acc, truth: dict, steps: list[int]) -> None:
    for family in ("weights_norm", "grads_norm", "update_ratio"):
        names = sorted(truth[0][family])
        for name in names:
            logged = {e.step: e.value for e in acc.Scalars(f"{family}/{name}")}
            assert sorted(logged) == steps, (family, name, logged)
            for step, value in logged.items():
                assert value == pytest.approx(truth[step][family][name], rel=1e-5), (family, name, step)


def gradients_and_updates(acc) -> dict[str, list[tuple[int, float]]]:
    """What was written of the gradients and the updates: every ``grads_*`` and ``update_ratio``
    scalar, the global gradient norm, and the gradients' histograms (their buckets)."""
    tags = acc.Tags()
    written = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]
               if tag.startswith(("grads_", "update_ratio/")) or tag == "layerwatch/grad_norm"}
    written.update({tag: [(e.step, e.histogram_value.bucket) for e in acc.Histograms(tag)] for tag in tags["histograms"]
                    if tag.startswith("grads/")})
    return written


@pytest.mark.parametrize("stage, persistence, watch, also", [
    (1, True, "engine", ("module-client",)), (2, True, "engine", ("module-client",)), (3, True, "engine", ()),
    (3, False, "engine", ()), (2, True, "module", ()), (3, False, "module", ()),
], ids=["zero1", "zero2", "zero3", "zero3-released", "zero2-module", "zero3-released-module"])
def test_zero_in_a_plain_loop_leaves_training_unchanged_and_logs_the_whole_tensors(stage, persistence, watch, also,
                                                                                   tmp_path, events):
    """Weights, gradients and update ratios of every parameter are those of the whole tensors, read
    from the ranks' partitions (gradients: the averaged and clipped ones DeepSpeed steps with),
    for the engine watched and for its module given with ``optimizer=engine.optimizer``. Under
    ZeRO-1 and 2, the module given with the user's own optimizer (the one given to
    ``deepspeed.initialize``) finds DeepSpeed's partitions through it: the same gradients and
    update ratios as the engine watched, bitwise, and nothing said."""
    run_ranks(zero_worker, str(tmp_path), stage, persistence, watch, -1, False, also, tmp=tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    for key in ("true", *also):
        assert results[key]["losses"] == results["false"]["losses"]  # bitwise
        assert results[key]["hooks"] == results["false"]["hooks"]  # DeepSpeed's own hooks only
        assert results[key]["alerts"] == []
        said = [m for m in results[key]["said"] if "sampled 3 time(s)" not in m]
        assert said == ([] if stage < 3 else [m for m in said if "under DeepSpeed ZeRO-3 a parameter is an empty placeholder" in m])
        assert len(said) == (stage == 3)  # once
    acc = events(tmp_path / "run")
    check_truth(acc, reference(2), [0, 2, 4])
    for name in also:
        written = gradients_and_updates(events(tmp_path / f"run-{name}"))
        assert len([t for t in written if t.startswith("update_ratio/")]) == 6
        assert written == gradients_and_updates(acc)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_with_a_compiled_module_is_measured_on_every_ranks_re_run_and_left_as_it_was(stage, tmp_path, events):
    """``engine.compile()``: every rank runs the sampled step's batch again eagerly, before its
    forward (ZeRO-3's gathers: the same collectives on every rank); the losses are bitwise, and the
    parameters are the whole tensors', as uncompiled. Under ZeRO-2 Dynamo compiles the same. ZeRO-3
    records the order its modules run in, and records it anew after a forward that breaks it, as
    the re-run does: its compiled code then takes other paths through DeepSpeed's hooks (6 graphs
    and 19 graph breaks without layerwatch, 8 and 11 with it, here)."""
    run_ranks(zero_worker, str(tmp_path), stage, True, "engine", -1, True, tmp=tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["true"]["losses"] == results["false"]["losses"]  # bitwise
    assert results["false"]["dynamo"][0] >= 1
    if stage < 3:
        assert results["true"]["dynamo"] == results["false"]["dynamo"]
    assert results["true"]["hooks"] == results["false"]["hooks"]
    acc = events(tmp_path / "run")
    check_truth(acc, reference(2), [0, 2, 4])
    for module in ("0", "2.0", "3"):
        assert [e.step for e in acc.Scalars(f"activations_norm/{module}")] == [0, 2, 4], module


def test_zero2_a_module_watched_without_its_optimizer_says_where_the_gradients_are(tmp_path, events):
    """ZeRO stages 1 and 2 leave no way from a parameter to its optimizer: the module given alone,
    or with an optimizer DeepSpeed does not step, is said once, with what to pass; its weights
    are still measured (every rank holds them whole). So is the engine given with an optimizer it
    does not step, whose hooks would never see a gradient."""
    run_ranks(zero_worker, str(tmp_path), 2, True, "module-alone", -1, False, ("module-other", "engine-other"), tmp=tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    for key, run, why in (("true", "run", "whose parameters do not lead to its optimizer"),
                          ("module-other", "run-module-other", "and the optimizer given (SGD) is not the one it steps")):
        assert results[key]["losses"] == results["false"]["losses"]
        (said,) = [m for m in results[key]["said"] if "trained by DeepSpeed ZeRO" in m]
        assert f"trained by DeepSpeed ZeRO (stage 1 or 2), {why}" in said
        assert "the optimizer given to deepspeed.initialize" in said and "optimizer=engine.optimizer" in said
        acc = events(tmp_path / run)
        assert [e.step for e in acc.Scalars("weights_norm/0.weight")] == [0, 2, 4]
        assert not [t for t in acc.Tags()["scalars"] if t.startswith(("grads_norm/", "update_ratio/"))]
    assert len([m for m in results["true"]["said"] if "sampled 3 time(s)" not in m]) == 1  # that alone
    (said,) = [m for m in results["engine-other"]["said"] if "is not the one DeepSpeed ZeRO steps" in m]
    assert "pass the optimizer given to deepspeed.initialize, or optimizer=engine.optimizer" in said
    assert results["engine-other"]["losses"] == results["false"]["losses"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_a_nan_deepspeed_skips_is_found_at_its_step(stage, tmp_path, events):
    """A NaN in one rank's batch at the unsampled step 3: DeepSpeed finds the averaged gradients'
    norm not finite and skips the step, without calling the optimizer (nor its hooks). Its own
    flag says so: found at step 3, on every rank alike."""
    run_ranks(zero_worker, str(tmp_path), stage, True, "engine", 3, tmp=tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["true"]["losses"] == results["false"]["losses"]
    (said,) = [m for m in results["true"]["said"] if "NaN/Inf gradients" in m]
    assert said.startswith("layerwatch: NaN/Inf gradients at step 3 (DeepSpeed found their norm not finite and skipped "
                           "the step)")
    acc = events(tmp_path / "run")
    assert [(e.step, e.value) for e in acc.Scalars("layerwatch/first_nonfinite_step")] == [(3, 3.0)]


# ---------------------------------------------------------------------- the Hugging Face Trainer


def hf_worker(rank: int, world: int, out: str, stage: int, persistence: bool) -> None:
    """A tiny GPT-2 under the Trainer with ``deepspeed=``, without and with the callback at its
    defaults and every 2 steps; rank 0 records the losses and the callbacks' alerts."""
    on_gloo()
    import transformers
    from hf_models import Tokens, tiny

    from layerwatch.huggingface import InspectTrainerCallback

    config = {**zero_config(stage, persistence), "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "train_batch_size": 4 * world, "gradient_clipping": 100.0}  # sizes set: "auto" fails on a CPU-only host
    results = {}
    for name, callbacks in (("plain", []), ("defaults", [InspectTrainerCallback()]), ("every2", [InspectTrainerCallback(every_n_steps=2)])):
        args = transformers.TrainingArguments(f"{out}/{name}", max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                                              save_strategy="no", seed=0, disable_tqdm=True, report_to=["tensorboard"],
                                              deepspeed=config, use_cpu=True, max_grad_norm=100.0)
        trainer = transformers.Trainer(model=tiny("gpt2"), args=args, train_dataset=Tokens(), callbacks=callbacks)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.train()
        results[name] = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                         "alerts": [a.message for c in callbacks for a in c.alerts],
                         "said": [str(w.message) for w in seen if "layerwatch" in str(w.message) and "time(s)" not in str(w.message)]}
    if rank == 0:
        Path(out, "results.json").write_text(json.dumps(results))


@pytest.mark.parametrize("stage, persistence", [(2, True), (3, True), (3, False)], ids=["zero2", "zero3", "zero3-released"])
def test_hf_trainer_with_deepspeed_zero_trains_as_without_and_reads_deepspeeds_gradients(stage, persistence, tmp_path, events):
    """ZeRO-3 under the Trainer crashed at the defaults (a gradient hook on a parameter ZeRO had
    partitioned away). Now the losses are bitwise those of the run without the callback, and the
    gradient norm is DeepSpeed's own (``train/grad_norm``, logged by HF), read in the step of the
    optimizer DeepSpeed steps, inside the Trainer's training_step."""
    run_ranks(hf_worker, str(tmp_path), stage, persistence, tmp=tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["defaults"]["losses"] == results["plain"]["losses"] == results["every2"]["losses"]
    assert results["defaults"]["alerts"] == results["every2"]["alerts"] == []
    for said in (results["defaults"]["said"], results["every2"]["said"]):
        assert [m for m in said if "ZeRO-3 a parameter is an empty placeholder" not in m] == []
        assert len(said) == (stage == 3)
    (run,) = sorted({p.parent for p in (tmp_path / "every2").rglob("events.out.tfevents.*")})
    acc = events(run)
    ours = {e.step: e.value for e in acc.Scalars("layerwatch/grad_norm")}
    hfs = {e.step: e.value for e in acc.Scalars("train/grad_norm")}
    assert sorted(ours) == [2, 4, 6]
    for step, value in ours.items():
        assert value == pytest.approx(hfs[step], rel=1e-5)
    weights = [t for t in acc.Tags()["scalars"] if t.startswith("weights_norm/")]
    assert len(weights) == len([t for t in acc.Tags()["scalars"] if t.startswith("grads_norm/")]) == 28
    assert all(e.value > 0 for t in weights for e in acc.Scalars(t))  # never a placeholder's 0.0
