"""Activation outliers (the "activations" family): each module output's max|h| / RMS(h), from the
rows its statistics come from (exact, eager and compiled alike), and the outlier_growth alert
provoked by a module one of whose values grows every step."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from layerwatch import Inspector
from layerwatch.stats import Rows
from layerwatch.stats import reduce as reduce_rows
from models import tab_values


def test_peak_to_rms_is_the_largest_magnitude_over_the_rms():
    torch.manual_seed(0)
    tensors = [torch.randn(100), torch.full((7,), -3.0), torch.zeros(4), torch.tensor([1.0, float("nan"), -5.0])]
    got = Rows(reduce_rows(tensors, 0).numpy()).peak_to_rms
    finite = [t[t.isfinite()].double() for t in tensors]
    expected = [t.abs().max().item() / t.pow(2).mean().sqrt().item() if t.abs().max() > 0 else np.nan for t in finite]
    np.testing.assert_allclose(got, expected, rtol=1e-9)
    assert got[1] == 1.0 and np.isnan(got[2])


class Grower(nn.Module):
    """Its input, one value of it (the first row's first feature) times 1.3 per step from ``start``."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start, self.step = start, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = torch.ones_like(x)
        gain[0, 0] = 1.3 ** max(0, self.step - self.start)
        return x * gain


def watched(log_dir, model: nn.Module, grower: Grower, steps: int = 40, lr: float = 1e-3):
    """``steps`` SGD steps of ``model`` on fresh batches, ``grower`` told each step, sampled every 2."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=log_dir, every_n_steps=2, optimizer=opt) as inspector:
            for k in range(steps):
                grower.step = k
                loss = model(torch.randn(16, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                inspector.step()
    return inspector


def run(log_dir, start):
    torch.manual_seed(0)
    grower = Grower(start)
    return watched(log_dir, nn.Sequential(nn.Linear(8, 32), grower, nn.ReLU(), nn.Linear(32, 4)), grower)


def test_a_value_that_grows_every_step_raises_outlier_growth_on_its_module(tmp_path, events):
    grown = run(tmp_path / "grown", start=16)
    alerts = [(a.name, a.step) for a in grown.alerts if a.kind == "outlier_growth"]
    assert alerts and {name for name, _ in alerts} <= {"1", "2"} and "1" in {name for name, _ in alerts}
    assert all(16 < step <= 40 for _, step in alerts)
    tab = tab_values(events(tmp_path / "grown"))
    outlier = tab["activations_outlier/1"]
    assert outlier[38] > 4 * outlier[10]
    assert "activations_outlier/1" not in events(tmp_path / "grown").Tags()["scalars"]  # the tab's, not a card
    healthy = run(tmp_path / "healthy", start=1000)
    assert not [a for a in healthy.alerts if a.kind == "outlier_growth"]
    with pytest.raises(ValueError, match="AlertRules.outlier_growth must be a number > 1, got 1"):
        from layerwatch import AlertRules

        AlertRules(outlier_growth=1)


def test_the_per_channel_kurtosis_is_written_from_the_first_sample_and_a_channel_taking_over_alerts(tmp_path, events):
    from layerwatch.probes.kurtosis import channel_kurtosis

    h = torch.randn(6, 5, 8)
    s2 = h.double().pow(2).reshape(-1, 8).mean(0)
    assert channel_kurtosis(h).item() == pytest.approx(((s2**2).mean() / s2.mean() ** 2).item(), rel=1e-6)

    class Channel(Grower):  # its input, its first channel times 1.5 per step from ``start``
        def forward(self, x):
            gain = torch.ones_like(x)
            gain[:, 0] = 1.5 ** max(0, self.step - self.start)
            return x * gain

    torch.manual_seed(0)
    grower = Channel(16)
    model = nn.Sequential(nn.Linear(8, 32), nn.Sequential(grower), nn.Linear(32, 4))  # a block: its kurtosis
    inspector = watched(tmp_path, model, grower, steps=32, lr=1e-4)
    kurtosis = tab_values(events(tmp_path))["activations_kurtosis/1"]
    assert min(kurtosis) == 0 and kurtosis[30] > 20 * kurtosis[10]  # from the first sampled step on
    assert not [t for t in tab_values(events(tmp_path)) if t.startswith("activations_kurtosis/0")]  # a leaf: none
    messages = [a.message for a in inspector.alerts if a.kind == "outlier_growth" and a.name == "1"]
    assert any("AlertRules.kurtosis_growth" in m for m in messages)
