"""Pipeline stages (``torch.distributed.pipelining``) on two CPU ranks (gloo), one stage each,
split by hand as torchtitan splits a model: every rank measures its own stage's layers, and rank
0 writes them all under their names in the whole model, at the same steps; pipelining's shape
inference is not counted as a call; training is unchanged. Every case runs through
:func:`ranks.run_ranks` (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and deadlines)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tensorboard.plugins.custom_scalar import layout_pb2

from layerwatch import Inspector
from layerwatch.sinks.record import custom_scalars_layout
from layerwatch.vocabulary import FAMILIES
from models import Stageable, hook_count, layerwatch_messages, stage_of, tab_values
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

STEPS = 6
MICRO = 4  # micro-batches per step
STATS = ("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")
BLOCK = ["", ".norm", ".fc", ".act"]
STAGE_MODULES = {  # what each stage runs, by the whole model's names
    0: ["inp"] + [f"layers.{b}{m}" for b in (0, 1) for m in BLOCK],
    1: [f"layers.{b}{m}" for b in (2, 3) for m in BLOCK] + ["out"],
}
WATCHED = {0: "layers.1.fc", 1: "out"}  # a module per stage whose first output each rank notes itself
POISONED = "layers.3.fc"  # on stage 1


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def statistics(t: torch.Tensor) -> dict[str, float]:
    a = t.detach().double().flatten()
    return {"mean": a.mean().item(), "std": a.std(unbiased=False).item(), "min": a.min().item(),
            "max": a.max().item(), "norm": a.norm().item(), "zero_frac": (a == 0).double().mean().item()}


def bitwise(a: torch.Tensor) -> torch.Tensor:
    return a.detach().view(torch.int32)


def pipeline_worker(rank: int, world: int, out: str, schedule_name: str, options: dict[str, Any], split: str = "manual",
                    fail_step: Optional[int] = None, poison_step: Optional[int] = None) -> None:
    """Train stage ``rank`` of :class:`~models.Stageable` under ``schedule_name`` twice from one
    seed, without and with an Inspector (``options``); assert that the losses and the weights
    are bitwise the same and that no hook stays; write what this rank saw itself (its
    gradients' and weights' statistics, update ratios, its watched module's first output) to
    ``out/rank<rank>.json``. ``fail_step``: rank 1 cannot read its rows to the host at that
    step; ``poison_step``: :data:`POISONED` outputs NaN at that step. ``split``: ``"manual"``
    (:func:`~models.stage_of`), ``"renumbered"`` (the same, its blocks numbered anew from 0) or
    ``"traced"`` (pipelining's own ``pipeline()``, split before ``layers.2``)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    from layerwatch.measure.reads import SampleReads

    if fail_step is not None and rank == 1:
        host_rows = SampleReads.host_rows

        def failing(self, sample):
            if sample.step == fail_step:
                raise RuntimeError("the rows were lost")
            return host_rows(self, sample)

        SampleReads.host_rows = failing
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    now, outputs = [0], []
    runs, seen, sampled, said = {}, {}, [], []

    def watch(module, args, output) -> None:
        outputs.append(output.detach().double().norm().item())

    def poison(module, args, output):
        if now[0] == poison_step:
            spoiled = output.clone()
            spoiled[0, 0] = float("nan")
            return spoiled

    for inspected in (False, True):
        torch.manual_seed(0)
        if split != "traced":
            part = stage_of(Stageable(), rank, world)
            if split == "renumbered":
                part.layers = torch.nn.ModuleDict({str(i): block for i, block in enumerate(part.layers.values())})
            stage = PipelineStage(part, rank, world, torch.device("cpu"))
        else:
            pipe = pipeline(Stageable(), mb_args=(torch.randn(2, 6),), split_spec={"layers.2": SplitPoint.BEGINNING})
            stage = pipe.build_stage(rank, torch.device("cpu"))
            part = stage.submod
        part.get_submodule(WATCHED[rank]).register_forward_hook(watch)
        if rank == 1 and poison_step is not None:
            part.get_submodule(POISONED).register_forward_hook(poison)
        schedule = kind(stage, n_microbatches=MICRO, loss_fn=mse)
        opt = torch.optim.SGD(part.parameters(), lr=0.05)
        hooks = hook_count(part, opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inspector = Inspector(part, log_dir=f"{out}/run", optimizer=opt, **options).start() if inspected else None
            losses = []
            for step in range(STEPS):
                now[0] = step
                torch.manual_seed(100 + step)
                x, y = torch.randn(2 * MICRO, 6), torch.randn(2 * MICRO, 3)
                step_losses: list[torch.Tensor] = []
                outputs.clear()
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=step_losses)
                before = {n: p.detach().double().clone() for n, p in part.named_parameters()}
                grads = {n: statistics(p.grad) for n, p in part.named_parameters()}
                opt.step()
                if inspector is not None:
                    if inspector.sampled:
                        sampled.append(step)
                    inspector.step()
                    after = {n: p.detach().double() for n, p in part.named_parameters()}
                    seen[step] = {
                        "grads": grads, "weights": {n: statistics(p) for n, p in after.items()},
                        "update": {n: ((after[n] - before[n]).norm() / after[n].norm()).item() for n in after},
                        "first_output": outputs[-MICRO],  # the step's first micro-batch (not the shape inference's)
                    }
                opt.zero_grad()
                losses.append([loss.item() for loss in step_losses])
            if inspector is not None:
                inspector.finish()
                assert hook_count(part, opt) == hooks
        if inspected:
            said = layerwatch_messages(caught)
        runs[inspected] = (losses, [bitwise(p) for p in part.parameters()])
    assert np.array_equal(np.array(runs[True][0]), np.array(runs[False][0]), equal_nan=True), runs
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"sampled": sampled, "seen": seen, "said": said}))


def at(acc, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def run(tmp_path: Path, events, schedule: str, options: dict[str, Any], split: str = "manual",
        **faults: int) -> tuple[Any, list[dict]]:
    """The run's event file, read back, and what each rank saw itself."""
    run_ranks(pipeline_worker, str(tmp_path), schedule, options, split, faults.get("fail_step"), faults.get("poison_step"),
              tmp=tmp_path)
    assert len(list((tmp_path / "run").glob("events.out.tfevents.*"))) == 1  # rank 0's
    return events(tmp_path / "run"), [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def check_stage(acc, seen: dict, steps: list[int], rank: int, tab: dict) -> None:
    """Every layer of ``rank``'s stage is in rank 0's file at ``steps``, with the values that
    rank computed itself."""
    for step in steps:
        reference = seen[str(step)]
        for family in ("grads", "weights"):
            for name, expected in reference[family].items():
                for stat, value in expected.items():
                    assert at(acc, f"{family}_{stat}/{name}")[step] == pytest.approx(value, rel=1e-5, abs=1e-7), (
                        rank, step, family, stat, name)
                assert tab[f"{family}_nonfinite/{name}"][step] == 0.0
                hist = {e.step: e.histogram_value for e in acc.Histograms(f"{family}/{name}")}[step]
                assert hist.num == sum(hist.bucket) > 0
        for name, ratio in reference["update"].items():
            assert at(acc, f"update_ratio/{name}")[step] == pytest.approx(ratio, rel=1e-4)
        assert at(acc, f"activations_norm/{WATCHED[rank]}")[step] == pytest.approx(reference["first_output"], rel=1e-5)
        for module in STAGE_MODULES[rank]:
            # Each of the step's micro-batches once: the shape inference's forward at the first step is no call.
            assert at(acc, f"calls/{module}")[step] == MICRO, (rank, step, module)
            assert at(acc, f"fwd_ms/{module}")[step] > 0 and at(acc, f"bwd_ms/{module}")[step] >= 0
            assert tab[f"nonfinite/{module}"][step] == 0.0
            assert step in {e.step for e in acc.Histograms(f"activations/{module}")}


@pytest.mark.parametrize("schedule, split", [("gpipe", "manual"), ("1f1b", "manual"), ("1f1b", "traced")])
def test_rank_0_logs_every_stage_under_the_whole_models_names(tmp_path, events, schedule, split):
    # GPipe at a fixed interval; 1F1B at the defaults (the overhead budget: rank 0's interval, shared).
    options = {"stats": STATS} | ({"every_n_steps": 2} if schedule == "gpipe" else {})
    acc, ranks = run(tmp_path, events, schedule, options, split)
    steps = ranks[0]["sampled"]
    assert ranks[1]["sampled"] == steps and (steps == [0, 2, 4] if schedule == "gpipe" else steps[:2] == [0, 1])
    tab = tab_values(acc)
    for rank in (0, 1):
        check_stage(acc, ranks[rank]["seen"], steps, rank, tab)
    tags = set(acc.Tags()["scalars"])
    # The model itself runs a different part on each stage: its per-module values are no one module's.
    assert not [tag for tag in tags | set(acc.Tags()["histograms"]) if tag.endswith("/(root)")]
    for step in steps:
        squares = [g["norm"] ** 2 for rank in (0, 1) for g in ranks[rank]["seen"][str(step)]["grads"].values()]
        assert at(acc, "layerwatch/grad_norm")[step] == pytest.approx(math.sqrt(sum(squares)), rel=1e-5)
        assert at(acc, "layerwatch/nonfinite_modules")[step] == 0
    assert "layerwatch/structure/text_summary" not in acc.Tags()["tensors"]
    # The Custom Scalars charts, written at the start, are those of every stage's layers (the model itself aside).
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    names = [name for rank in (0, 1) for name in ranks[rank]["seen"][str(steps[0])]["grads"]]
    expected = custom_scalars_layout(names, STAGE_MODULES[0] + STAGE_MODULES[1], FAMILIES, STATS)
    assert {category.title: [chart.title for chart in category.chart] for category in layout.category} == {
        category: list(charts) for category, charts in expected.items()}
    assert len(expected["layerwatch: fwd_ms"]) > 1  # more layers than one chart holds: split by block
    assert any("pipeline stages" in message and "layer table" in message for message in ranks[0]["said"])


def test_a_stage_that_cannot_send_its_rows_still_takes_part_and_a_nan_it_makes_is_named(tmp_path, events):
    acc, ranks = run(tmp_path, events, "gpipe", {"every_n_steps": 2}, fail_step=2, poison_step=4)
    assert ranks[0]["sampled"] == ranks[1]["sampled"] == [0, 2, 4]
    first, last = "inp.weight", "out.weight"  # on stage 0, on stage 1
    assert sorted(at(acc, f"grads_norm/{first}")) == sorted(at(acc, f"weights_norm/{first}")) == [0, 2, 4]
    assert sorted(at(acc, f"grads_norm/{last}")) == sorted(at(acc, f"weights_norm/{last}")) == [0, 4]
    # Stage 1's per-module values still came at step 2, and the model's gradient norm is not made up from half of it.
    assert sorted(at(acc, "fwd_ms/out")) == [0, 2, 4]
    assert sorted(at(acc, "layerwatch/grad_norm")) == [0, 4]
    assert any("rank(s) 1 could not read or send their stage's weights and gradients at step 2" in m for m in ranks[0]["said"])
    (text,) = acc.Tensors("layerwatch/first_offender/text_summary")
    assert text.tensor_proto.string_val[0].decode().startswith(f"step 4, forward: {POISONED} turned finite inputs into")
    tab = tab_values(acc)
    assert tab[f"nonfinite/{POISONED}"] == {0: 0.0, 2: 0.0, 4: 1.0}
    # Its gradient reached stage 0, whose modules are flagged too; none is named: their gradients came non-finite.
    assert tab["nonfinite/inp"] == {0: 0.0, 2: 0.0, 4: 1.0}


def test_stages_that_do_not_keep_the_whole_models_names_are_said_and_rank_0s_layers_still_logged(tmp_path, events):
    acc, ranks = run(tmp_path, events, "gpipe", {"every_n_steps": 2, "stats": STATS}, "renumbered")
    assert ranks[0]["sampled"] == [0, 2, 4]  # rank 0's schedule; rank 1 measures nothing
    (said,) = [m for m in ranks[0]["said"] if "several stages hold parameters of the same name" in m]
    assert "layers.0.norm.weight" in said and "nn.ModuleDict" in said
    logged = {tag.split("/", 1)[1] for tag in acc.Tags()["scalars"] if tag.startswith("grads_norm/")}
    assert logged == set(ranks[0]["seen"]["0"]["grads"])  # stage 0's alone: stage 1's would collide with its names
    check_stage(acc, ranks[0]["seen"], [2, 4], 0, tab_values(acc))  # step 0 records the layer table: no latency
    assert [at(acc, f"calls/{module}")[0] for module in STAGE_MODULES[0]] == [MICRO] * len(STAGE_MODULES[0])


@pytest.mark.parametrize("stages, expected", [
    ([("forward", "a"), ("forward", "b")], "a"),  # the earliest stage's forward
    ([None, ("forward", "b")], "b"),
    ([("backward", "a"), ("backward", "b")], "b"),  # else the latest stage's backward
    ([("backward", "a"), ("forward", "b")], "b"),
    ([("forward", "a"), "missing"], "a"),  # a missing stage after it cannot have come first
    (["missing", ("forward", "b")], None),  # one before it may have
    ([("backward", "a"), "missing"], None),
])
def test_the_pipelines_first_offender(stages, expected):
    from layerwatch.probes import Offender, ProbeResult
    from layerwatch.engine.stages import first_offender

    results = [None if found == "missing" else ProbeResult([], None if found is None else Offender(found[1], found[0]))
               for found in stages]
    offender = first_offender(results)
    assert (offender and offender.name) == expected
