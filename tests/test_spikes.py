"""The spike rule and the loss tap (layerwatch.spikes), on their own: not wired to the engine yet."""

import math
import random

import pytest
import torch

from layerwatch.spikes import LossTap, SpikeDetector, SpikeRule


def test_a_jump_past_six_deviations_of_the_trailing_window_is_a_spike_and_noise_is_not():
    rng = random.Random(0)
    detector = SpikeDetector(SpikeRule())
    losses = [2.0 + 0.01 * rng.gauss(0, 1) for _ in range(500)]
    assert [s for step, v in enumerate(losses) if (s := detector.observe(step, v))] == []
    spike = detector.observe(500, 2.5)
    assert spike is not None and (spike.step, spike.what, spike.value) == (500, "loss", 2.5)
    assert spike.z > 6 and spike.mean == pytest.approx(2.0, abs=0.01) and spike.std == pytest.approx(0.01, rel=0.3)


def test_nothing_is_judged_before_the_warmup_a_flat_window_or_a_falling_loss():
    detector = SpikeDetector(SpikeRule(warmup=8, window=16))
    assert all(detector.observe(step, 1.0) is None for step in range(8))
    assert detector.observe(8, 100.0) is None  # a flat window: no deviation to measure against
    falling = SpikeDetector(SpikeRule(warmup=4, window=8))
    assert all(falling.observe(step, 10.0 / (step + 1)) is None for step in range(50))  # a drop is no spike


def test_a_nan_is_left_to_the_sentinel_and_the_window_forgets_what_left_it():
    detector = SpikeDetector(SpikeRule(warmup=4, window=4, z=3.0))
    for step, v in enumerate([1.0, 1.1, 0.9, 1.0]):
        assert detector.observe(step, v) is None
    assert detector.observe(4, math.nan) is None and detector.observe(5, math.inf) is None
    assert detector.observe(6, 5.0) is not None  # judged against the four before, NaN and Inf not among them
    for step in range(7, 11):  # the spike left the window after four more values
        detector.observe(step, 1.0 + 0.1 * (step % 2))
    assert detector.observe(11, 1.05) is None


def test_the_running_sums_match_the_window_after_many_windows():
    rng = random.Random(1)
    detector = SpikeDetector(SpikeRule(window=16, warmup=16))
    values = [1e4 + rng.random() for _ in range(10_000)]
    for step, v in enumerate(values):
        detector.observe(step, v)
    window = values[-16:]
    assert detector._sum == pytest.approx(math.fsum(window), rel=1e-12)
    assert detector._squares == pytest.approx(math.fsum(v * v for v in window), rel=1e-12)


@pytest.mark.parametrize("bad", [dict(z=0), dict(z=math.inf), dict(z=True), dict(window=1), dict(warmup=1),
                                 dict(capture=-1), dict(window=8, warmup=9), dict(window=8.0)])
def test_a_bad_rule_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match="SpikeRule"):
        SpikeRule(**bad)


def test_the_tap_averages_a_steps_losses_and_gives_each_closed_step_once(monkeypatch):
    tap = LossTap()
    tap.offer(0, torch.tensor(2.0))
    tap.offer(0, 4.0)  # a second micro-batch
    tap.offer(1, torch.tensor([1.0, 3.0]))  # several values: their mean
    assert tap.landed(closed=0) == [(0, 3.0)]
    assert tap.landed(closed=1) == [(1, 2.0)] and tap.landed(closed=1) == []
    with pytest.raises(TypeError, match="loss must be a tensor or a number, got str"):
        tap.offer(2, "2.0")


def test_the_tap_starts_a_copy_where_reads_are_not_free_and_reads_it_once_landed(monkeypatch):
    """Taking the accelerator's way on the CPU: no value is read at offer time."""
    from layerwatch import stats

    monkeypatch.setattr(stats, "host_reads_free", lambda device: False)
    tap = LossTap()
    loss = torch.tensor(5.0)
    tap.offer(3, loss)
    loss.fill_(0.0)  # the copy was taken at offer time
    assert tap.landed(closed=3) == [(3, 5.0)]
