"""DDP on CPU: two ranks with ddp_spawn; rank 0 alone writes, gradients are the synchronized ones."""

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from ranks import run_python

# Lightning spawns the ranks itself; the whole fit runs in a process of its own, with a deadline.
FIT = """
import lightning.pytorch as L
from lightning.pytorch.loggers import TensorBoardLogger
from pathlib import Path

from ranks import tolerate_abort_at_exit
from layerwatch import InspectCallback
from models import LitMLP

if __name__ == "__main__":
    out = Path({out!r})
    model = LitMLP(record_dir=str(out))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4, logger=TensorBoardLogger(out, name="ddp", version=0),
        callbacks=[InspectCallback(every_n_steps=2)], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, default_root_dir=out,
    )
    with tolerate_abort_at_exit(out / "rank0.json", out / "rank1.json"):  # written by on_train_end
        trainer.fit(model)
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_ddp_spawn_rank_zero_writes_each_sample_once_with_synchronized_grads(tmp_path, events):
    run_python(FIT.format(out=str(tmp_path)))

    files = list((tmp_path / "ddp" / "version_0").glob("events.out.tfevents.*"))
    histogram_steps = [
        event.step
        for f in files
        for event in LegacyEventFileLoader(str(f)).Load()
        for value in event.summary.value
        if value.tag == "grads/net.0.weight"
    ]
    assert sorted(histogram_steps) == [0, 2]  # written once per sampled step, by one rank

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["batches"][0] != ranks[1]["batches"][0]  # each rank trained on its own data...
    logged = {e.step: e.value for e in events(tmp_path / "ddp" / "version_0").Scalars("grads_norm/net.0.weight")}
    for step in (0, 2):
        on_rank = [r["grad_norms"][str(step)]["net.0.weight"] for r in ranks]
        assert on_rank[0] == pytest.approx(on_rank[1], rel=1e-6)  # ...yet holds the all-reduced gradient
        assert logged[step] == pytest.approx(on_rank[0], rel=1e-5)


BUDGET_FIT = """
import lightning.pytorch as L
from lightning.pytorch.loggers import TensorBoardLogger
from pathlib import Path

from ranks import tolerate_abort_at_exit
from layerwatch import InspectCallback
from models import LitMLP, ScriptedBudget

if __name__ == "__main__":
    out = Path({out!r})
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=23,
        logger=TensorBoardLogger(out, name="ddp", version=0),
        callbacks=[ScriptedBudget([3.0, 1.0], str(out)), InspectCallback()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, default_root_dir=out,
    )
    with tolerate_abort_at_exit(out / "sampled0.json", out / "sampled1.json"):
        trainer.fit(LitMLP())
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_ddp_spawn_under_the_overhead_budget_every_rank_samples_rank_zeros_steps(tmp_path, events):
    # Rank 0's pacer wants every 5th step, rank 1's every step (scripted): rank 0's choice is shared.
    run_python(BUDGET_FIT.format(out=str(tmp_path)))
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"sampled{rank}.json").read_text())
        assert seen == {"sampled": [0, 1, 5, 10, 15, 20], "state": {"last_written_step": 20, "sample_interval": 5}}
    logged = {e.step: e.value for e in events(tmp_path / "ddp" / "version_0").Scalars("layerwatch/sample_interval")}
    assert logged == {0: 1, 1: 5, 5: 5, 10: 5, 15: 5, 20: 5}
