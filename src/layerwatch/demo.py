"""The built-in demo: a small classifier trained on generated data with Lightning and
``InspectCallback``. It leaves a TensorBoard run behind."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
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
from layerwatch.options import writable_dir

FAULT = "encoder.fault"  # the layer that emits the injected NaN or loss spike
SPIKE_SCALE = -1e3  # what the fault layer multiplies its output by at a spike's step: sure of the wrong answers


def make_data(n: int, d_in: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian blobs around random class centres: learnable, but not instantly."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d_in, generator=g) * 0.6
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centres[y] + torch.randn(n, d_in, generator=g), y)


class FaultInjector(nn.Module):
    """An identity layer (it returns its input itself) until ``fire`` is set: then its first
    unit outputs NaN; or until ``scale`` is set: then its output is its input times that (a
    loss spike). A layer of its own, so that layerwatch's first offender names it."""

    def __init__(self) -> None:
        super().__init__()
        self.fire = False
        self.scale: Optional[float] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            return x * self.scale
        if not self.fire:
            return x
        return x * torch.where(torch.arange(x.shape[-1], device=x.device) == 0, math.nan, 1.0)


class DemoModule(L.LightningModule):
    """An MLP classifier; at step ``inject_nan`` its layer ``encoder.fault`` (after the second
    Linear) outputs NaN in its first unit, for that one step; at step ``inject_spike`` it
    multiplies its output by ``SPIKE_SCALE`` (a loss spike), for that one step."""

    def __init__(self, d_in: int = 32, hidden: int = 256, classes: int = 4, inject_nan: Optional[int] = None,
                 inject_spike: Optional[int] = None) -> None:
        super().__init__()
        # The named fault layer has no parameters and keeps the numbered layers' names.
        self.encoder = nn.Sequential(OrderedDict([
            ("0", nn.Linear(d_in, hidden)), ("1", nn.ReLU()), ("2", nn.Linear(hidden, hidden)),
            ("fault", FaultInjector()),
            ("3", nn.ReLU()), ("4", nn.Linear(hidden, hidden)), ("5", nn.ReLU()),
        ]))
        self.head = nn.Linear(hidden, classes)
        self.inject_nan, self.inject_spike = inject_nan, inject_spike

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.encoder.fault.fire = self.training and self.global_step == self.inject_nan
        spiking = self.training and self.global_step == self.inject_spike
        self.encoder.fault.scale = SPIKE_SCALE if spiking else None
        return self.head(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/accuracy", (logits.argmax(-1) == y).float().mean())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def check_demo_options(steps: int, every: int, inject_nan: Optional[int], inject_spike: Optional[int] = None) -> None:
    """Raises ValueError naming the bad value: ``steps`` and ``every`` must be ints >= 1,
    ``inject_nan`` and ``inject_spike`` None or a step of the run (``0 <= step < steps``)."""
    for name, value in (("steps", steps), ("every", every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, step in (("inject_nan", inject_nan), ("inject_spike", inject_spike)):
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < steps):
            raise ValueError(f"{name} must be a step of the run, an int in 0..{steps - 1} (steps={steps}), got {step!r}")


def run_demo(steps: int = 8000, log_dir: str = "runs/layerwatch-demo", every: int = 50,
             inject_nan: Optional[int] = None, batch: int = 128, inject_spike: Optional[int] = None) -> Path:
    """Train ``DemoModule`` for ``steps`` optimizer steps; returns the run directory.

    Lightning's progress bar counts the epochs those steps span: the default 8,000 steps of
    157 batches an epoch end in epoch 50 of 0..50 ("Epoch 50/50"); the last epoch may stop
    part of the way through its bar, at ``steps``.

    With ``inject_nan``, that step need not be sampled: the NaN sentinel sees its gradients
    go NaN before Adam's step, the callback runs the step's batch again with every probe
    armed, and ``encoder.fault`` is named as the first offender, "replayed from step N". (The
    step after it could not tell: Adam has spread the NaN into every weight by then, so the
    first layer is merely the first to use one.)

    With ``inject_spike``, ``encoder.fault`` multiplies its output by ``SPIKE_SCALE`` (-1000)
    at that step: the model is sure of the wrong answers, the loss spikes, that step is sampled
    with its batch replayed, and the spike is said to have begun at ``encoder.fault`` (the
    ``spike`` alert, the tab's spike mark). (Times +1000, a classifier that fits its data is
    sure of the right answers: its loss falls.)

    Raises:
        ValueError: a bad ``steps``, ``every``, ``inject_nan`` or ``inject_spike`` (see :func:`check_demo_options`),
            or a ``log_dir`` that cannot be written; before training starts.
    """
    check_demo_options(steps, every, inject_nan, inject_spike)
    writable_dir(log_dir)
    callback = InspectCallback(every_n_steps=every)
    L.seed_everything(0, verbose=False)
    loader = DataLoader(make_data(20_000), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    logger = TensorBoardLogger(log_dir, name="demo")
    trainer = _trainer(steps, every, len(loader), logger, callback)
    started = time.perf_counter()
    trainer.fit(DemoModule(inject_nan=inject_nan, inject_spike=inject_spike), loader)
    run_dir = Path(logger.log_dir)
    print(f"\nlayerwatch demo: {steps} steps in {time.perf_counter() - started:.0f} s; TensorBoard logs in {run_dir.resolve()}")
    _say_what_was_found(callback, every, inject_nan, inject_spike)
    print(f"view them with:\n  tensorboard --logdir {log_dir}\n(the LAYERWATCH tab shows every layer at every "
          f"sampled step)\nor summarize them (alerts, extreme norms) with:\n  layerwatch report {log_dir}")
    return run_dir


def _trainer(steps: int, every: int, batches: int, logger: TensorBoardLogger, callback: InspectCallback) -> "L.Trainer":
    """The demo's Trainer: ``steps`` optimizer steps on the CPU, of ``batches`` an epoch."""
    return L.Trainer(
        max_steps=steps,
        # max_steps ends the run; the epochs it spans only name the last one in the progress
        # bar ("Epoch 50/50", not Lightning's "Epoch 50/-2" for an unbounded run).
        max_epochs=math.ceil(steps / batches),
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[callback],
        log_every_n_steps=every,
        enable_checkpointing=False,
        enable_model_summary=False,
    )


def _say_what_was_found(callback: InspectCallback, every: int, inject_nan: Optional[int],
                        inject_spike: Optional[int]) -> None:
    """What layerwatch found of the faults injected (a NaN, a spike), and where it shows."""
    if inject_nan is not None:
        found = next((a.message for a in callback.alerts if a.message.startswith("first offender")),
                     "first offender: none found")
        sampled = "a sampled step" if inject_nan % every == 0 else "between samples"
        print(f"a NaN was injected at step {inject_nan} ({sampled}) by layer {FAULT} (its first unit's output); "
              f"layerwatch's {found}. See the LAYERWATCH tab, the layerwatch/first_offender text, "
              "layerwatch/first_nonfinite_step, and the grads_nonfinite/ and weights_nonfinite/ cards")
    if inject_spike is not None:
        found = next((a.message for a in callback.alerts if a.kind == "spike" and a.step == inject_spike),
                     "no spike found at that step")
        print(f"the loss was made to spike at step {inject_spike} by layer {FAULT} (its output times {SPIKE_SCALE:g}); "
              f"layerwatch: {found}. See the LAYERWATCH tab's spike mark, layerwatch/loss and `layerwatch report`")
