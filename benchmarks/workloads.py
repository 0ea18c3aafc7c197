"""The training workloads the overhead benchmark measures, in plain torch.

Each factory, ``WORKLOADS[name](device="cpu")``, returns ``(model, optimizer, step)`` where
``step()`` runs one full optimizer step (forward, backward, optimizer) on a fixed synthetic
batch on ``device`` and returns the (detached) loss. Nothing is random after construction (no
dropout), so every step does the same work. The model is built on the CPU from the seed, then
moved, so its initial weights do not depend on the device.

    gpt       6-block causal GPT (d 384, vocab 8192), batch 8 x 128 tokens, AdamW
    cnn       ResNet-18 (7x7/2 stem + max pool, 4 stages of 2 BasicBlocks, 100 classes),
              batch 32 x 3x64x64, SGD momentum 0.9
    stack     200 residual Linear(256, 256) + ReLU blocks, batch 1024, SGD
    stack32   the same stack at batch 32 (400 small tensors, tiny step)
    tfm       nn.TransformerEncoder, 12 layers, d 256, 4 heads, ff 1024, vocab 1000,
              batch 16 x 32 tokens, AdamW
    tfm-tiny  the same with 6 layers, d 128, 4 heads, ff 512, batch 4 x 64 tokens, AdamW
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Workload = tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class SmallGPT(nn.Module):
    def __init__(self, vocab: int = 8192, d: int = 384, layers: int = 6, heads: int = 6, seq: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln_f(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        widths, layers, cin = (64, 128, 256, 512), [], 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(cin, w, stride), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


class EncoderLM(nn.Module):
    """Token embedding, ``nn.TransformerEncoder`` (post-norm, no dropout), linear head to the vocabulary."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.tok(idx)))


class Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.act = nn.ReLU()
        with torch.no_grad():
            self.linear.weight.mul_(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def _make_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor]):
    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss.detach()

    step.loss_fn = loss_fn  # the forward and loss alone (what a replay runs again)
    return step


def gpt(seed: int = 0, device: torch.device | str = "cpu") -> Workload:
    torch.manual_seed(seed)
    model = SmallGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 8192, (8, 128)).to(device)
    target = torch.randint(0, 8192, (8, 128)).to(device)
    return model, opt, _make_step(model, opt, lambda: F.cross_entropy(model(idx).flatten(0, 1), target.flatten()))


def cnn(seed: int = 0, device: torch.device | str = "cpu") -> Workload:
    torch.manual_seed(seed)
    model = ResNet18().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(32, 3, 64, 64).to(device)
    y = torch.randint(0, 100, (32,)).to(device)
    return model, opt, _make_step(model, opt, lambda: F.cross_entropy(model(x), y))


def stack(seed: int = 0, device: torch.device | str = "cpu", batch: int = 1024) -> Workload:
    torch.manual_seed(seed)
    model = nn.Sequential(*(Residual(256) for _ in range(200))).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 256).to(device)
    return model, opt, _make_step(model, opt, lambda: model(x).square().mean())


def stack32(seed: int = 0, device: torch.device | str = "cpu") -> Workload:
    return stack(seed, device, batch=32)


def _encoder_lm(seed: int, device: torch.device | str, vocab: int, d: int, layers: int, heads: int, ff: int,
                batch: int, seq: int) -> Workload:
    torch.manual_seed(seed)
    model = EncoderLM(vocab, d, layers, heads, ff).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, vocab, (batch, seq)).to(device)
    target = torch.randint(0, vocab, (batch, seq)).to(device)
    return model, opt, _make_step(model, opt, lambda: F.cross_entropy(model(idx).flatten(0, 1), target.flatten()))


def tfm(seed: int = 0, device: torch.device | str = "cpu") -> Workload:
    return _encoder_lm(seed, device, vocab=1000, d=256, layers=12, heads=4, ff=1024, batch=16, seq=32)


def tfm_tiny(seed: int = 0, device: torch.device | str = "cpu") -> Workload:
    return _encoder_lm(seed, device, vocab=1000, d=128, layers=6, heads=4, ff=512, batch=4, seq=64)


WORKLOADS = {"gpt": gpt, "cnn": cnn, "stack": stack, "stack32": stack32, "tfm": tfm, "tfm-tiny": tfm_tiny}
