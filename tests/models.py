"""The tests' one zoo of models and the helpers that train them: plain modules, the awkward
cases of the reliability tests (``CASES``), the replay's faults; and, from ``lit_models``, the
LightningModules with their Trainer, imported when one is asked for (``from models import
LitMLP`` works): a rank's process that unpickles a plain worker does not import Lightning,
some 3 s each."""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F
from torch.optim import optimizer as optimizer_module
from torch.utils.data import TensorDataset

from layerwatch.engine.budget import Pacer


MEASURED_IDEAL = Pacer.ideal


def scripted_ideal(wanted: Callable[[], float]) -> Callable[[Pacer], Optional[float]]:
    """A ``Pacer.ideal`` that says ``wanted()`` once the real one knows a sample's cost, and None
    (no interval yet) before: the overhead budget's choices, scripted."""
    def ideal(pacer: Pacer, extra: bool = True) -> Optional[float]:
        return None if MEASURED_IDEAL(pacer) is None else wanted()

    return ideal


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


class Opaque(torch.Tensor):
    """A tensor subclass that takes part in autograd but lets no function read its values: no
    probe can measure it (the way a probe fails, without patching layerwatch)."""

    ALLOWED = {"as_subclass", "__get__", "__set__", "detach", "register_hook", "__repr__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in cls.ALLOWED:
            raise RuntimeError(f"Opaque does not support {getattr(func, '__name__', func)}")
        return super().__torch_function__(func, types, args, kwargs or {})


class Sluggish(torch.Tensor):
    """A tensor subclass whose every function but the model's own takes ``DELAY`` seconds more:
    a probe that reads it is slow (the way to slow layerwatch's hooks, without patching them)."""

    DELAY = 0.002

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in Opaque.ALLOWED:
            time.sleep(cls.DELAY)
        return super().__torch_function__(func, types, args, kwargs or {})


class _Hide(nn.Module):
    def __init__(self, as_type: type) -> None:
        super().__init__()
        self.as_type = as_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.as_subclass(self.as_type)


class _Show(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.as_subclass(torch.Tensor)


class HiddenMiddle(nn.Sequential):
    """An MLP whose hidden activation is of ``as_type`` (:class:`Opaque`: no probe can read it;
    :class:`Sluggish`: reading it is slow) between ``hide`` and ``show``; the loss is computed
    as without it."""

    def __init__(self, as_type: type = Opaque) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.hide = _Hide(as_type)
        self.show = _Show()
        self.fc2 = nn.Linear(16, 4)


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


class TinyTransformer(nn.Module):
    """A token embedding, one pre-norm encoder layer (attention through SDPA, dropout) and a
    head: a transformer in miniature, for the layer table of a compiled model."""

    def __init__(self, vocab: int = 40, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(idx)))


class ResidualBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(self.norm(x)))


class Stageable(nn.Module):
    """An input layer, residual blocks in an ``nn.ModuleDict`` and an output layer, written as
    torchtitan writes its models for pipeline parallelism: a stage is a copy of the whole model
    less what other stages run (:func:`stage_of`), and its forward runs what is left."""

    def __init__(self, d_in: int = 6, d: int = 8, blocks: int = 4, d_out: int = 3) -> None:
        super().__init__()
        self.inp: Optional[nn.Module] = nn.Linear(d_in, d)
        self.layers = nn.ModuleDict({str(i): ResidualBlock(d) for i in range(blocks)})
        self.out: Optional[nn.Module] = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for layer in self.layers.values():
            x = layer(x)
        return x if self.out is None else self.out(x)


def stage_of(model: Stageable, stage: int, stages: int) -> Stageable:
    """Stage ``stage`` of ``stages`` of ``model``, split by hand as torchtitan does: a deep copy
    with the other stages' blocks deleted from the ``ModuleDict`` (the kept ones keep their
    names) and the input and output layers on the first and last stages only."""
    part = copy.deepcopy(model)
    per_stage = len(model.layers) // stages
    kept = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
    for key in list(part.layers.keys()):
        if key not in kept:
            del part.layers[key]
    if stage > 0:
        part.inp = None
    if stage < stages - 1:
        part.out = None
    return part


class Restless(nn.Module):
    """A forward with the side effects a second forward must not leave behind: its own code
    draws from Python's and NumPy's generators, dropout from torch's, BatchNorm in train mode
    updates its running statistics, and its last output is kept as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.last: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if random.random() + np.random.rand() >= 0 else 0.0
        self.last = self.drop(self.bn(self.fc(x))) * scale
        return self.last


def run_state(model: nn.Module) -> list:
    """What a forward run again could change: the generators (torch's, Python's, NumPy's), the
    buffers, the gradients and the modules' modes."""
    return [torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(),
            *[b.clone() for b in model.buffers()], *[p.grad.clone() for p in model.parameters() if p.grad is not None],
            [m.training for m in model.modules()]]


def same_state(a: list, b: list) -> bool:
    """Whether two :func:`run_state` are equal, bitwise."""
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(a, b)
    )


class ReadsOnHost(nn.Module):
    """A Linear whose output is halved when its largest value passes 100: a forward that reads
    a value on the host (``.item()``), which cannot run under fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y / 2 if y.abs().max().item() > 100 else y


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
    from layerwatch.reading.events import Reader

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


def train_step(loss_of, opt: torch.optim.Optimizer, inspector=None, replay: bool = False) -> str:
    """One optimizer step of ``loss_of()`` (given to ``replay_with`` first with ``replay``), then
    ``inspector.step()``: its loss, exactly."""
    if inspector is not None and replay:
        inspector.replay_with(loss_of)
    loss = loss_of()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if inspector is not None:
        inspector.step()
    return repr(loss.item())


# ------------------------------------------------------------------------------- the replay's faults

FAULT_STEP = 7


class FaultAt(nn.Module):
    """Identity, except at step ``step`` (as set in ``now`` by the loop): one value of its output
    turns to NaN, its input finite. Set by step, not by call, so that a replay of that step
    makes the NaN again."""

    def __init__(self, step: int = FAULT_STEP) -> None:
        super().__init__()
        self.step, self.now = step, -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.now != self.step:
            return x
        return x * torch.where(torch.arange(x.shape[-1], device=x.device) == 0, math.nan, 1.0)


class _NaNGradientAlways(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


class BackwardFaultAt(FaultAt):
    """Identity in forward; at step ``step`` its backward returns NaN from a finite gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NaNGradientAlways.apply(x) if self.now == self.step else x


def make_model(fault: FaultAt) -> nn.Sequential:
    """The issue's set-up: Linear, Tanh, Linear, Dropout, the fault, Tanh, BatchNorm, Linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.2), fault, nn.Tanh(),
                         nn.BatchNorm1d(16), nn.Linear(16, 1))


def train_steps(call, fault: FaultAt, opt, batches, inspector=None, closure_wrapper=None, replay: bool = True) -> list[str]:
    """One step per ``(x, y)`` of ``batches``, the MSE of ``call(x)``; with an inspector, its
    closure handed to ``inspector.replay_with`` first (through ``closure_wrapper``, when given;
    not with ``replay=False``) and ``inspector.step()`` after it. Returns the losses, exactly
    (``repr``)."""
    losses = []
    for k, (x, y) in enumerate(batches):
        fault.now = k

        def compute_loss(x=x, y=y):
            return nn.functional.mse_loss(call(x), y)

        if inspector is not None and replay:
            inspector.replay_with(compute_loss if closure_wrapper is None else closure_wrapper(compute_loss))
        loss = compute_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(repr(loss.item()))
        if inspector is not None:
            inspector.step()
    return losses


def same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))


# ------------------------------------------------------------------------------- the zoo's cases
# Awkward models for the reliability tests, each with its own training step. A ``Case`` builds a
# model and its optimizers, and runs one optimizer step (``step``), drawing its data from the
# global RNG, so two runs seeded alike see the same batches. ``messages`` are the one-time
# messages layerwatch is expected to give for it (regexes); any other layerwatch warning fails
# the test.

@dataclass
class Out:
    logits: torch.Tensor
    extra: dict


class StructuredOutputs(nn.Module):
    """Returns a tuple of a tensor, a dict with a None and a non-tensor, a dataclass and a string."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 2), "b": nn.Linear(8, 2)})

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return h, {"a": self.heads["a"](h), "none": None, "count": 3}, Out(self.heads["b"](h), {"k": "v"}), "text"


class InPlaceAfter(nn.Module):
    """In-place ops on module outputs: ReLU(inplace=True) and an add_ on a Linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        h.add_(0.5)
        return self.fc2(self.act(h))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h, _ = self.lstm(x)
        h, _ = self.gru(h)
        return self.head(h[:, -1])


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


class SometimesUnused(nn.Module):
    """The ``rare`` branch runs on even steps only; its gradients are None on odd steps."""

    def __init__(self) -> None:
        super().__init__()
        self.common = nn.Linear(8, 8)
        self.rare = nn.Linear(8, 8)

    def forward(self, x, use_rare: bool):
        h = self.common(x)
        return self.rare(h) if use_rare else h


class ComplexWeights(nn.Module):
    """A complex-valued parameter: measured through its real and imaginary parts."""

    def __init__(self) -> None:
        super().__init__()
        self.filter = nn.Parameter(torch.randn(8, 8, dtype=torch.complex64) * 0.1)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head((x.to(torch.complex64) @ self.filter).abs())


class Exotic(torch.Tensor):
    """A tensor subclass whose reductions fail: the statistics cannot handle it."""

    BLOCKED = {"aminmax", "isfinite", "amin", "amax", "sum", "linalg_vector_norm", "norm", "_foreach_norm", "cat", "_foreach_copy_"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls.BLOCKED:
            raise RuntimeError(f"Exotic does not support {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


class WithExoticParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.ghost = nn.Parameter(torch.ones(3).as_subclass(Exotic), requires_grad=False)

    def forward(self, x):
        return self.fc(x)


def sgd(model: nn.Module) -> list[torch.optim.Optimizer]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.optim.SGD(params, lr=0.05, momentum=0.9)] if params else []


def plain_step(loss_of: Callable[[nn.Module], torch.Tensor]) -> Callable:
    def step(model: nn.Module, optimizers: list, k: int) -> float:
        loss = loss_of(model)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        return loss.item()

    return step


def _structured(model):
    h, d, out, _ = model(torch.randn(16, 8))
    return h.pow(2).mean() + d["a"].pow(2).mean() + out.logits.pow(2).mean()


def _autocast_step(model, optimizers, k):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    optimizers[0].zero_grad()
    loss.backward()
    optimizers[0].step()
    return loss.item()


def _no_params_step(model, optimizers, k):
    x = torch.randn(16, 8, requires_grad=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.item()


def _unused_step(model, optimizers, k):
    loss = model(torch.randn(16, 8), use_rare=k % 2 == 0).pow(2).mean()
    optimizers[0].zero_grad()
    loss.backward()
    optimizers[0].step()
    return loss.item()


def _accumulation_step(model, optimizers, k):
    optimizers[0].zero_grad()
    total = 0.0
    for _ in range(3):
        loss = model(torch.randn(8, 8)).pow(2).mean() / 3
        loss.backward()
        total += loss.item()
    optimizers[0].step()
    return total


def _two_optimizers(model):
    return [torch.optim.SGD(model.fc1.parameters(), lr=0.05), torch.optim.Adam(model.fc2.parameters(), lr=1e-3)]


def _compiled():
    return torch.compile(MLP(), backend="eager")


@dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]
    step: Callable[[nn.Module, list, int], float]
    optimizers: Callable[[nn.Module], list] = sgd
    messages: tuple[str, ...] = field(default_factory=tuple)


CASES = [
    Case("structured outputs", StructuredOutputs, plain_step(_structured)),
    Case("module reused", SharedLayer, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean())),
    Case("tied weights", TiedLM, plain_step(lambda m: m(torch.randint(0, 20, (4, 6))).logsumexp(-1).mean())),
    Case("in-place after a module", InPlaceAfter, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean())),
    Case("LSTM and GRU", Recurrent, plain_step(lambda m: m(torch.randn(4, 5, 4)).pow(2).mean())),
    Case("checkpoint", InPlaceCheckpointed, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean())),
    Case("autocast bf16", MLP, _autocast_step),
    Case("sparse embedding", SparseEmbedding, plain_step(lambda m: m(torch.randint(0, 50, (4, 6))).pow(2).mean()),
         lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)], messages=(r"gradient of 'emb.weight' is sparse",)),
    Case("no parameters", NoParams, _no_params_step, messages=("the model has no parameters",)),
    Case("frozen backbone", FrozenBackbone, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean())),
    Case("parameters unused in some steps", SometimesUnused, _unused_step),
    Case("gradient accumulation", MLP, _accumulation_step),
    Case("several optimizers", MLP, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean()), _two_optimizers),
    Case("torch.compile", _compiled, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean())),
    Case("complex parameter", ComplexWeights, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean())),
    Case("a parameter the statistics cannot handle", WithExoticParameter,
         plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean()), messages=(r"could not measure the weights of 'ghost' \(Exotic",)),
]


# ------------------------------------------------------------------------------- Lightning

def dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1, keepdim=True) > 0).float())


class NaNOnRankOne(nn.Module):
    """Identity, except on rank 1 at global step ``step``: its output turns to NaN."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.now, self.rank = step, -1, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if self.rank == 1 and self.now == self.step else x


def __getattr__(name: str):
    if name.startswith("__"):  # (an import asks for __path__: no Lightning for that)
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    import lit_models

    try:
        return getattr(lit_models, name)
    except AttributeError:
        raise AttributeError(f"module 'models' has no attribute {name!r}") from None


def causal(score, batch, head, query, key):
    """A FlexAttention score_mod: causal attention."""
    return torch.where(query >= key, score, float("-inf"))


def min_entropy_heads(q, k):
    """Causal attention's every row, in float64: ``[heads, 2]``, each head's largest logit and
    its rows' mean min-entropy (logsumexp − max)."""
    logits = q.double() @ k.double().transpose(-2, -1) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~torch.ones(logits.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    top, lse = logits.amax(-1), logits.logsumexp(-1)  # (batch, heads, queries)
    return torch.stack([top.amax((0, 2)), (lse - top).mean((0, 2))], 1)


class SdpaAttention(nn.Module):
    """Causal attention through ``F.scaled_dot_product_attention``, or with ``flex`` through
    FlexAttention (causal by a score_mod)."""

    def __init__(self, d: int = 16, heads: int = 2, flex: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.flex = heads, d // heads, flex
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape  # as many heads as q's columns hold: all, or this rank's under tensor parallel
        split = lambda t: t.view(b, n, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if self.flex:
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q, k, v, score_mod=causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class SdpaBlock(nn.Module):
    def __init__(self, d: int = 16, flex: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(d), SdpaAttention(d, flex=flex), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drop = (lambda h: F.dropout(h, self.dropout, self.training)) if self.dropout else (lambda h: h)  # noqa: E731
        x = x + drop(self.attn(self.norm(x)))
        return x + drop(self.mlp(x))


def lm_step(call, opt: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    """One optimizer step of a causal LM ``call`` on token ``ids``, each position predicting the
    next: its loss."""
    loss = F.cross_entropy(call(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


class SdpaLM(nn.Module):
    """A two-block causal LM whose attention calls ``F.scaled_dot_product_attention`` (16 wide,
    2 heads, vocabulary 32), or with ``flex`` FlexAttention; its output head ``head``; with
    ``dropout``, on each block's two residual branches."""

    def __init__(self, vocab: int = 32, d: int = 16, flex: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed, self.blocks = nn.Embedding(vocab, d), nn.ModuleList([SdpaBlock(d, flex, dropout) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
