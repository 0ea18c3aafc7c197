"""The NaN sentinel's share of the gradients on the CPU: every gradient, in turn."""

import math

import pytest
import torch
from torch import nn

from layerwatch import Inspector, at_steps
from layerwatch import sentinel as sentinel_module
from layerwatch.sentinel import NonfiniteSentinel


def params(sizes):
    return [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_shares_cover_every_gradient_value_once_and_hold_at_most_their_budget(monkeypatch):
    monkeypatch.setattr(sentinel_module, "CPU_MIN_BYTES", 1)
    monkeypatch.setattr(sentinel_module, "CPU_ROTATION", 16)
    named = params([100, 100, 100, 100, 800, 50])  # bytes: 400 x4, 3200, 200; total 5,000; budget 313 a share
    sentinel = NonfiniteSentinel()
    sentinel.watch(named, lambda t: t)
    covered = {name: torch.zeros(p.numel()) for name, p in named}
    for share in sentinel._shares:
        size = 0
        for name, p, values in share:
            covered[name][values if values is not None else slice(None)] += 1
            size += covered[name][values if values is not None else slice(None)].numel() * 4
        assert size <= 313
    assert all(bool((c == 1).all()) for c in covered.values())  # every value once
    # slices of 78 values: p0..p3 two shares each, p4 eleven, its last slice shared with p5
    assert sentinel.rotation == len(sentinel._shares) == 4 * 2 + 11


def test_small_models_are_checked_whole_on_every_step():
    sentinel = NonfiniteSentinel()
    sentinel.watch(params([1000, 10]), lambda t: t)
    assert sentinel.rotation == 1


def test_a_nan_that_stays_is_found_within_one_rotation(tmp_path, events, monkeypatch):
    monkeypatch.setattr(sentinel_module, "CPU_MIN_BYTES", 1)
    monkeypatch.setattr(sentinel_module, "CPU_ROTATION", 8)  # 1,152 bytes of gradients: 144 a share
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))  # each weight in two slices, a bias with the second: 8 shares
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found = []
    with pytest.warns(RuntimeWarning, match="the sentinel, each gradient at least every 8 steps") as seen:
        with Inspector(model, log_dir=tmp_path, schedule=at_steps([]), optimizer=opt) as inspector:
            for k in range(20):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                if k >= 5:
                    model[2].bias.grad[0] = math.nan  # from step 5 on, and the weights go NaN with it
                opt.step()
                inspector.step()
    found = [s.step for s in events(tmp_path).Scalars("layerwatch/first_nonfinite_step")]
    assert len(found) == 1 and 5 <= found[0] < 5 + 8
    assert any("2.bias" in str(w.message) or "2.weight" in str(w.message) for w in seen)
