"""A zoo of small models for the tests (defined at module level so they pickle)."""

from __future__ import annotations

from typing import Iterable, Optional

import math
import torch
from torch import nn
from torch.optim import optimizer as optimizer_module


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self, vocab: int = 20, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, vocab, bias=False)
        self.proj.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(idx))


class FrozenBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


class NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


SHORT_RUN_NOTE = "layerwatch: this run was sampled"  # the end-of-run note of a run too short for the alert windows


def layerwatch_messages(seen) -> list[str]:
    """layerwatch's warnings among ``seen`` (warning records or messages), less the short-run note."""
    messages = [str(getattr(w, "message", w)) for w in seen]
    return [m for m in messages if m.startswith("layerwatch") and not m.startswith(SHORT_RUN_NOTE)]


def hook_count(model: nn.Module, optimizers: Optional[torch.optim.Optimizer | Iterable[torch.optim.Optimizer]] = None) -> int:
    """Hooks on ``model`` (modules and parameters), on ``optimizers`` (the ones the run really
    stepped), and the process-wide module and optimizer hooks."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    per_module = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )
    per_param = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    per_param += sum(len(p._backward_hooks or {}) for p in model.parameters())
    module_globals = (
        nn.modules.module._global_forward_hooks,
        nn.modules.module._global_forward_pre_hooks,
        nn.modules.module._global_backward_hooks,
        nn.modules.module._global_backward_pre_hooks,
    )
    process_wide = sum(len(d) for d in module_globals)
    process_wide += len(optimizer_module._global_optimizer_pre_hooks) + len(optimizer_module._global_optimizer_post_hooks)
    on_optimizers = sum(len(o._optimizer_step_pre_hooks) + len(o._optimizer_step_post_hooks) for o in optimizers or ())
    return per_module + per_param + process_wide + on_optimizers


def train(model: nn.Module, steps: int, inspector=None, *, optimizer=None, seed: int = 0, d_in: int = 8,
          before_step=None) -> list[float]:
    """Train on fixed synthetic data; returns the losses (exact floats). ``before_step(k)``,
    when given, runs before step ``k`` (to break something mid-run)."""
    torch.manual_seed(seed)
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for k in range(steps):
        if before_step is not None:
            before_step(k)
        x = torch.randn(32, d_in)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if inspector is not None:
            inspector.step()
    return losses



def train_through_scaler_overflow(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, inspector) -> None:
    """Steps under a CPU GradScaler whose first scale overflows, so the optimizer skips step 0."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-60)
    for _ in range(steps):
        loss = model(torch.randn(16, 8)).pow(2).mean() * 1e4
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        inspector.step()

class Amplifier(nn.Module):
    """Multiplies by ``gain``: its backward overflows a gradient that reaches it finite, as an
    fp16 matmul does under a GradScaler's first, too large, scale."""

    def __init__(self, gain: float = 1e6) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def train_through_overflow_in_a_module(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, inspector) -> None:
    """Steps under a CPU GradScaler whose first scale (2**120) makes a finite loss gradient
    overflow inside ``model``'s backward (an :class:`Amplifier`), so the optimizer skips step 0."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120, backoff_factor=2.0**-60)
    for _ in range(steps):
        loss = model(torch.randn(16, 8)).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        inspector.step()


class SmallCNN(nn.Module):
    """The edge-deployment tool's reference model: input 1x28x28, ten classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool2 = nn.MaxPool2d(2)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(torch.relu(self.conv1(x)))
        x = self.pool2(torch.relu(self.conv2(x)))
        return self.fc(x.flatten(1))


class SharedLayer(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(torch.relu(self.layer(x))))


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.conv(x)))


class FourBranches(nn.Module):
    """Four independent heads on one input, each with its own loss term (see ``train_branches``):
    ``dead`` never fires its ReLU, ``no_lr`` sits in a param group with lr 0, ``growing`` has
    its weights doubled after every step by the training loop, ``healthy`` is left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = nn.Linear(8, 8)
        self.no_lr = nn.Linear(8, 8)
        self.growing = nn.Linear(8, 8)
        self.healthy = nn.Linear(8, 8)
        with torch.no_grad():
            self.dead.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.relu(self.dead(x)), self.no_lr(x), self.growing(x), self.healthy(x)]


def train_branches(model: FourBranches, steps: int, inspector=None, seed: int = 0) -> None:
    torch.manual_seed(seed)
    others = [*model.dead.parameters(), *model.growing.parameters(), *model.healthy.parameters()]
    opt = torch.optim.SGD([{"params": others}, {"params": model.no_lr.parameters(), "lr": 0.0}], lr=0.01)
    for _ in range(steps):
        x = torch.randn(16, 8)
        loss = sum((out - x).pow(2).mean() for out in model(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.growing.weight.mul_(2.0)
        if inspector is not None:
            inspector.step()


class InPlaceCheckpointed(nn.Module):
    """In-place ReLUs after Linears, and a block recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.act(self.a(x))
        return self.head(torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False))


def tab_values(acc) -> dict[str, dict[int, float]]:
    """Every per-layer value in the LAYERWATCH tab's data of a run (an ``EventAccumulator``
    read with ``tensors: 0``): ``{"activation_bytes/fc1": {step: value}}``. It holds the
    series that are not TensorBoard cards too (bytes; NaN/Inf counts of healthy layers)."""
    from layerwatch.tensorboard_plugin.metadata import Reader

    reader = Reader()
    for tag in acc.Tags()["tensors"]:
        if tag.startswith("layerwatch/") and not tag.endswith("/text_summary"):
            for event in acc.Tensors(tag):
                reader.add_tensor(event.step, event.wall_time, tag, event.tensor_proto)
    out: dict[str, dict[int, float]] = {}
    for key in reader.keys():
        for step, (names, values) in reader.series(key).items():
            for name, value in zip(names, values.tolist()):
                if value != float("-inf"):  # -inf: not measured at that step
                    out.setdefault(f"{key}/{name}", {})[step] = value
    return out


class Poison(nn.Module):
    """Identity, except at ``step``: its output turns to NaN (its input stays finite)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.calls = step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * math.nan if self.calls - 1 == self.step else x


class Spoiler(nn.Module):
    """Identity times a buffer: 1 until a test fills it with NaN. A buffer, not a Python flag,
    so that compiled code runs the same graph either way."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _NaNGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spoil):
        ctx.save_for_backward(spoil)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (spoil,) = ctx.saved_tensors
        return grad * spoil, None


class GradientSpoiler(Spoiler):
    """Identity whose gradient is multiplied by the buffer (NaN: a fault made in backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NaNGradient.apply(x, self.scale)


class Chain(nn.Sequential):
    """``nn.Sequential`` with a forward of user code, as most models' is: ``module.compile()``
    starts compiling there (from ``torch.nn``'s own ``forward`` it does not)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = module(x)
        return x


def spoilable(spoiler: nn.Module) -> Chain:
    """Linear, Tanh, the spoiler, Linear, ReLU, Linear (8 -> 4)."""
    torch.manual_seed(0)
    return Chain(nn.Linear(8, 16), nn.Tanh(), spoiler, nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def compile_as(model: nn.Module, how: str, backend) -> nn.Module:
    """What to call for ``model`` compiled ``how``: "torch.compile(model)" (its wrapper),
    "model.compile()" (the model, compiled in place), or anything else (the model as is)."""
    if how == "torch.compile(model)":
        return torch.compile(model, backend=backend)
    if how == "model.compile()":
        model.compile(backend=backend)
    return model
