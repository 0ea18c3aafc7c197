"""The built-in demo: a small classifier trained on generated data with Lightning and
``InspectCallback``. It leaves a TensorBoard run behind."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import TensorBoardLogger
except ImportError:  # the older package name
    import pytorch_lightning as L  # type: ignore[no-redef]
    from pytorch_lightning.loggers import TensorBoardLogger  # type: ignore[no-redef]

from layerwatch.lightning import InspectCallback


def make_data(n: int, d_in: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian blobs around random class centres: learnable, but not instantly."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d_in, generator=g) * 0.6
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centres[y] + torch.randn(n, d_in, generator=g), y)


class DemoModule(L.LightningModule):
    """An MLP classifier; at ``inject_nan`` its first encoder unit outputs NaN for one step."""

    def __init__(self, d_in: int = 32, hidden: int = 256, classes: int = 4, inject_nan: Optional[int] = None) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head = nn.Linear(hidden, classes)
        self.inject_nan = inject_nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        if self.training and self.global_step == self.inject_nan:
            h = h * torch.where(torch.arange(h.shape[-1], device=h.device) == 0, math.nan, 1.0)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/accuracy", (logits.argmax(-1) == y).float().mean())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run_demo(steps: int = 8000, log_dir: str = "runs/layerwatch-demo", every: int = 50,
             inject_nan: Optional[int] = None, batch: int = 128) -> Path:
    """Train ``DemoModule`` for ``steps`` optimizer steps; returns the run directory."""
    L.seed_everything(0, verbose=False)
    loader = DataLoader(make_data(20_000), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    logger = TensorBoardLogger(log_dir, name="demo")
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[InspectCallback(every_n_steps=every)],
        log_every_n_steps=every,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    started = time.perf_counter()
    trainer.fit(DemoModule(inject_nan=inject_nan), loader)
    run_dir = Path(logger.log_dir)
    print(f"\nlayerwatch demo: {steps} steps in {time.perf_counter() - started:.0f} s; TensorBoard logs in {run_dir.resolve()}")
    if inject_nan is not None:
        print(f"a NaN was injected at step {inject_nan}: see layerwatch/first_nonfinite_step, the "
              "layerwatch/first_offender text, and the nonfinite/ and weights_nonfinite/ cards")
    print(f"view them with:\n  tensorboard --logdir {log_dir}\nor summarize them (alerts, extreme norms) with:\n"
          f"  layerwatch report {log_dir}")
    return run_dir
