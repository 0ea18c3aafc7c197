"""Awkward models for the reliability tests: each with its own training step.

A ``Case`` builds a model and its optimizers, and runs one optimizer step (``step``), drawing
its data from the global RNG, so two runs seeded alike see the same batches. ``messages``
are the one-time messages layerwatch is expected to give for it (regexes); any other
layerwatch warning fails the test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from models import FrozenBackbone, InPlaceCheckpointed, MLP, NoParams, SharedLayer, TiedLM


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
    Case("torch.compile", _compiled, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean()),
         # the plain run compiled MLP.forward first: this instance's hooks are never run, and that is said
         messages=(r"torch.compile'd; on sampled steps, hooks compiled into its graph", r"another instance of its class")),
    Case("complex parameter", ComplexWeights, plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean())),
    Case("a parameter the statistics cannot handle", WithExoticParameter,
         plain_step(lambda m: m(torch.randn(16, 8)).pow(2).mean()), messages=(r"could not measure the weights of 'ghost' \(Exotic",)),
]
