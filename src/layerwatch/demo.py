"""The built-in demo: a small classifier trained on generated data with the Inspector.

Runs in well under a minute on a laptop CPU and leaves a TensorBoard run behind.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from layerwatch.inspector import Inspector


class DemoNet(nn.Module):
    """A small MLP classifier; ``poison`` makes its second layer emit a NaN once."""

    def __init__(self, d_in: int = 32, hidden: int = 128, classes: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        if self.poison:
            h = h * torch.where(torch.arange(h.shape[-1]) == 0, math.nan, 1.0)
        return self.head(h)


def make_data(n: int, d_in: int = 32, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs around random class centres: learnable, but not instantly."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d_in, generator=g) * 1.5
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + torch.randn(n, d_in, generator=g), y


def run_demo(steps: int = 600, log_dir: str = "runs/layerwatch-demo", every: int = 20,
             inject_nan: Optional[int] = None, batch: int = 64) -> Path:
    """Train ``DemoNet`` for ``steps`` optimizer steps with an Inspector; returns the log dir."""
    torch.manual_seed(0)
    x, y = make_data(steps * batch if steps * batch < 200_000 else 200_000)
    model = DemoNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run_dir = Path(log_dir)
    started = time.perf_counter()
    with Inspector(model, log_dir=run_dir, every_n_steps=every, optimizer=optimizer) as inspector:
        for step in range(steps):
            idx = torch.randint(0, len(x), (batch,))
            model.poison = step == inject_nan
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            inspector.step()
            if step % max(steps // 10, 1) == 0 or step == steps - 1:
                print(f"step {step:>5}/{steps}  loss {loss.item():.4f}", flush=True)
    print(f"done in {time.perf_counter() - started:.1f} s; TensorBoard logs in {run_dir.resolve()}")
    print(f"view them with:\n  tensorboard --logdir {run_dir}")
    return run_dir
