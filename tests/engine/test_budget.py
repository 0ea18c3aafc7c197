"""The overhead budget, the default schedule: the interval's arithmetic, its hysteresis, and the
engine sampling multiples of it, saying it, logging it and resuming it.

The engine tests script what the pacer measures (``Pacer.ideal``), so that which steps are
sampled does not depend on this machine's timings; one test lets the real measurements choose.
"""

import math

import pytest
import torch

from layerwatch import Inspector
from layerwatch.engine.budget import CHECKS_FLOOR_S, MAX_INTERVAL, MAX_SPREAD, Pacer, grid_index, grid_value
from layerwatch.options import validate_options
from layerwatch.measure import params
from models import MLP, scripted_ideal, train

INTERVAL_TAG = "layerwatch/sample_interval"


def test_the_grid_is_1_2_5_and_its_index_rounds_up():
    assert [grid_value(i) for i in range(10)] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    for value, expected in [(0.2, 1), (1, 1), (1.01, 2), (2, 2), (2.1, 5), (7, 10), (150, 200), (200, 200),
                            (201, 500), (999, 1000), (12_345, 20_000)]:
        assert grid_value(grid_index(value)) == expected, value


def measured(pacer: Pacer, *, base_ms: float, own_ms: float, cost_ms: float, samples: int = 2) -> None:
    for _ in range(8):
        pacer.off_step(base_ms / 1e3, own_ms / 1e3)
    for _ in range(samples):
        pacer.sampled(cost_ms / 1e3, (base_ms + cost_ms) / 1e3)


def test_the_interval_is_the_smallest_grid_value_within_the_budget():
    # planned at HEADROOM (80%) of the budget: 1% of a 10 ms step is 0.08 ms to spend
    pacer = Pacer(0.01)
    measured(pacer, base_ms=10, own_ms=0, cost_ms=16)  # 16 ms / n <= 0.08 ms: n >= 200
    assert pacer.ideal() == pytest.approx(200) and pacer.decide() == 200
    pacer = Pacer(0.01)
    measured(pacer, base_ms=10, own_ms=0.04, cost_ms=16)  # the unsampled steps' own cost leaves 0.04 ms: n >= 400
    assert pacer.decide() == 500
    pacer = Pacer(0.05)
    measured(pacer, base_ms=10, own_ms=0, cost_ms=16)  # 0.4 ms a step to spend: n >= 40
    assert pacer.decide() == 50
    pacer = Pacer(1.0)
    measured(pacer, base_ms=10, own_ms=0, cost_ms=5)  # a sample costs less than the budget of one step
    assert pacer.decide() == 1


def test_samples_the_pacer_did_not_schedule_are_paid_out_of_the_budget_then_forgotten():
    from layerwatch.engine.budget import EXTRA_SPAN

    pacer = Pacer(0.01)
    measured(pacer, base_ms=10, own_ms=0, cost_ms=16)  # 0.08 ms a step to spend: every 200 steps
    for step in (1001, 1002, 1003):  # a spike's capture: 3 x 16 ms over the next 1024 steps, 0.047 ms a step
        pacer.unscheduled(step, 0.016)
    assert pacer.extra_per_step() == pytest.approx(0.048 / EXTRA_SPAN)
    assert pacer.ideal() == pytest.approx(0.016 / (0.08e-3 - 0.048 / EXTRA_SPAN)) and pacer.decide() == 500
    assert pacer.expected_share(500) == pytest.approx((0.016 / 500 + 0.048 / EXTRA_SPAN) / 0.010)
    pacer.sampled(0.016, 0.026, step=1003 + EXTRA_SPAN)  # the capture has left the span
    assert pacer.extra_per_step() == 0 and pacer.decide() == 200


def test_the_first_sample_is_left_out_and_every_step_is_sampled_until_a_cost_is_known():
    pacer = Pacer(0.01)
    assert [k for k in range(5) if pacer(k)] == [0, 1, 2, 3, 4]
    pacer.sampled(5.0, 6.0)  # the first sample: plans, the layer table, a compile
    assert pacer.ideal() is None and pacer.decide() is None
    pacer.sampled(0.002, 0.012)  # no unsampled step yet: the sample's own step, less its cost, is the base
    assert pacer.ideal() == pytest.approx(0.002 / (0.8 * 0.01 * 0.010))
    pacer.interval = pacer.decide()
    assert pacer.interval == 50  # the ideal, 25, rounded up the grid
    assert [k for k in range(200) if pacer(k)] == [0, 50, 100, 150]  # multiples: the same steps on every run


def test_a_first_sample_that_seems_all_cost_takes_a_tenth_of_its_time_as_the_base():
    # timers read a cost as long as the step itself (noise, a write): a base near zero would
    # choose the longest interval, not corrected before its next sample, 10,000 steps on
    pacer = Pacer(0.05)
    pacer.sampled(5.0, 6.0)
    pacer.sampled(0.013, 0.012)
    assert pacer.ideal() == pytest.approx(0.013 / (0.8 * 0.05 * 0.0012))
    assert pacer.decide() == 500


def test_the_interval_grows_at_once_and_shrinks_only_two_grid_steps_below():
    pacer = Pacer(0.01)
    pacer.interval = 200
    ideals = iter([150, 101, 100, 201, 90, 60])
    pacer.ideal = lambda: next(ideals)
    assert pacer.decide() is None  # 150 and 101: one grid step below, kept (no flapping 200 <-> 100)
    assert pacer.decide() is None
    assert pacer.decide() is None  # 100 is still one grid step (200 -> 100); 50 would be two
    assert pacer.decide() == 500  # over the budget: at once
    pacer.interval = 500
    assert pacer.decide() == 100  # 90 rounds up to 100, two grid steps below 500
    pacer.interval = 100
    assert pacer.decide() is None


def test_a_per_step_cost_over_the_budget_takes_the_longest_interval_and_says_so():
    pacer = Pacer(0.01)
    measured(pacer, base_ms=1, own_ms=0.2, cost_ms=10)  # the sentinel alone: 20% of a step
    assert pacer.ideal() == math.inf
    pacer.interval = pacer.decide()
    assert pacer.interval == MAX_INTERVAL
    assert "the longest interval" in pacer.message(None) and "sentinel=False" in pacer.message(None)


def test_a_sentinel_over_its_share_is_spread_and_the_interval_stays_finite():
    pacer = Pacer(0.01)
    for _ in range(8):
        pacer.off_step(20e-3, 0.42e-3, 0.4e-3)  # the sentinel: 2% of a 20 ms step, its allowance 0.08 ms
    for _ in range(2):
        pacer.sampled(5e-3, 25e-3)
    assert pacer.ideal() == math.inf  # as it stands, no interval keeps the budget
    assert pacer.checks_allowance() == pytest.approx(0.5 * 0.8 * 0.01 * 20e-3)
    assert pacer.spread_for(1) == 5  # 0.4 ms over 0.08 ms
    pacer.interval = pacer.decide()
    assert pacer.interval < MAX_INTERVAL  # its cost taken at the allowance until measured again
    assert pacer.spread_for(5) is None  # nothing measured since
    for _ in range(8):
        pacer.off_step(20e-3, 0.12e-3, 0.1e-3)  # spread over 5 steps: a little over its allowance still
    assert pacer.spread_for(5) == 7
    for _ in range(8):
        pacer.off_step(20e-3, 2e-3, 2e-3)
    assert pacer.spread_for(1000) == MAX_SPREAD and pacer.spread_for(MAX_SPREAD) is None  # the most it spreads


def test_a_sentinel_within_its_share_is_left_whole():
    pacer = Pacer(0.01)
    for _ in range(8):
        pacer.off_step(10e-3, 0.05e-3, 0.03e-3)
    assert pacer.spread_for(1) == 1  # measured, and within


def test_a_sentinel_check_under_the_floor_is_left_whole_however_short_the_step():
    pacer = Pacer(0.01)
    for _ in range(8):
        pacer.off_step(1e-3, 0.05e-3, 0.04e-3)  # 4% of a 1 ms step, but under 50 us
    assert pacer.checks_allowance() == CHECKS_FLOOR_S and pacer.spread_for(1) == 1


def test_the_message_is_one_plain_line():
    pacer = Pacer(0.01)
    pacer.interval = 200
    assert pacer.message(None) == ("layerwatch: sampling every 200 steps to stay within a 1% overhead budget; "
                                   "pass every_n_steps= to fix the interval")
    pacer.interval = 500
    assert "every 500 steps (was every 200)" in pacer.message(200)


# ---------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, math.nan, True, "1%"])
def test_a_budget_outside_0_1_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=f"overhead_budget must be a number in \\(0, 1\\].*got {bad!r}"):
        validate_options(overhead_budget=bad)


@pytest.mark.parametrize("other", [{"every_n_steps": 10}, {"schedule": [1, 2]}])
def test_a_budget_with_a_fixed_schedule_is_an_error_naming_both(other):
    ((name, value),) = other.items()
    with pytest.raises(ValueError, match=f"overhead_budget=0.05.*{name}=|{name}=.*overhead_budget=0.05"):
        Inspector(MLP(), overhead_budget=0.05, **other)


def test_the_budget_is_the_default_and_a_fixed_schedule_keeps_todays_behaviour():
    assert validate_options().budget == 0.01 and validate_options().schedule is None
    assert validate_options(overhead_budget=1).budget == 1.0
    fixed = validate_options(every_n_steps=50)
    assert fixed.budget is None and [k for k in range(120) if fixed.schedule(k)] == [0, 50, 100]


# ---------------------------------------------------------------------------------------- the engine


def run(tmp_path, steps, *, ideal_at, monkeypatch, nan_at=None, state=None, **options):
    """Train an MLP under the default schedule with ``Pacer.ideal`` scripted per step; returns
    the inspector, the steps written and their logged intervals."""
    current = {"step": 0}
    monkeypatch.setattr(Pacer, "ideal", scripted_ideal(lambda: ideal_at(current["step"])))
    model = MLP()
    written = {}
    inspector = Inspector(model, log_dir=tmp_path, **options)
    if state is not None:
        inspector.load_state_dict(state)
    inspector.add_sink(lambda record: written.__setitem__(record.step, record.scalars.get(INTERVAL_TAG)))

    def before(k):
        current["step"] = k + (0 if state is None else state["step"])
        if nan_at is not None and current["step"] == nan_at:
            model.fc1.weight.data[0, 0] = math.nan

    with inspector:
        train(model, steps, inspector, before_step=before)
    return inspector, written


def test_the_engine_samples_0_and_1_then_multiples_logging_the_interval(tmp_path, monkeypatch, capfd):
    inspector, written = run(tmp_path, 130, ideal_at=lambda k: 15 if k < 60 else 35, monkeypatch=monkeypatch)
    # 15 -> every 20 from step 1; at 60 the ideal 35 -> 50 (over the budget: at once); 100 is a multiple of 50.
    assert list(written) == [0, 1, 20, 40, 60, 100]
    assert written == {0: 1, 1: 20, 20: 20, 40: 20, 60: 50, 100: 50}
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "sampling every" in line]
    assert lines == [
        "layerwatch: sampling every 20 steps to stay within a 1% overhead budget; pass every_n_steps= to fix the interval",
        "layerwatch: sampling every 50 steps (was every 20) to stay within a 1% overhead budget; pass every_n_steps= "
        "to fix the interval",
    ]
    assert inspector.state_dict() == {"step": 130, "sample_interval": 50}


def test_a_nan_between_samples_still_samples_the_next_step(tmp_path, monkeypatch, recwarn):
    _, written = run(tmp_path, 40, ideal_at=lambda k: 150, monkeypatch=monkeypatch, nan_at=7)
    assert 0 in written and 1 in written
    assert [k for k in written if 7 < k < 40]  # the sentinel's finding samples a step soon after, not the 200th


def test_a_resumed_inspector_goes_on_with_its_interval(tmp_path, monkeypatch, capfd):
    _, written = run(tmp_path, 60, ideal_at=lambda k: 15, monkeypatch=monkeypatch,
                     state={"step": 1000, "sample_interval": 20})
    assert list(written) == [1000, 1020, 1040]  # no early samples: the interval is known
    assert "sampling every" not in capfd.readouterr().err  # unchanged, so not said again


def test_a_fixed_schedule_logs_no_interval_and_says_nothing(tmp_path, monkeypatch, capfd):
    _, written = run(tmp_path, 12, ideal_at=lambda k: 15, monkeypatch=monkeypatch, every_n_steps=5)
    assert written == {0: None, 5: None, 10: None}
    assert "sampling every" not in capfd.readouterr().err


def test_a_sentinel_over_its_share_of_the_budget_is_spread_said_once_and_still_finds_a_nan(
        tmp_path, monkeypatch, capfd, recwarn):
    """A sentinel allowed nothing (no share, no floor): spread as far as it goes, one tensor a
    share, said once; a NaN that reaches the weights is still found."""
    import layerwatch.engine.budget as budget

    monkeypatch.setattr(budget, "PER_STEP_SHARE", 1e-9)
    monkeypatch.setattr(budget, "CHECKS_FLOOR_S", 0.0)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, optimizer=opt) as inspector:
        for k in range(60):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if k == 40:
                model.fc2.weight.grad[0, 0] = math.nan  # once; the weights carry it on
            opt.step()
            opt.zero_grad()
            inspector.step()
        spread = inspector._engine._sampling.sentinel_spread
    assert spread == budget.MAX_SPREAD  # its allowance is nothing: as far as it goes
    said = [line for line in capfd.readouterr().err.splitlines() if "NaN sentinel" in line]
    assert len(said) == 1 and "each at least every 4 steps" in said[0]  # every tensor of the MLP, a share of its own
    found = [str(w.message) for w in recwarn if "NaN/Inf gradients at step" in str(w.message)]
    assert len(found) == 1 and int(found[0].split("at step ")[1].split()[0]) >= 40


def test_bad_resume_state_names_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"sample_interval.*got 0"):
        Inspector(MLP(), log_dir=tmp_path).load_state_dict({"step": 3, "sample_interval": 0})


def test_the_real_measurements_choose_a_grid_interval_that_keeps_the_budget(tmp_path, capfd):
    model = MLP(d_in=64, hidden=256, d_out=64)
    written = {}
    inspector = Inspector(model, log_dir=tmp_path, overhead_budget=0.05, sentinel=False)
    inspector.add_sink(lambda record: written.__setitem__(record.step, record.scalars[INTERVAL_TAG]))
    with inspector:
        train(model, 300, inspector, d_in=64)
    pacer = inspector.schedule
    grid = {grid_value(i) for i in range(grid_index(MAX_INTERVAL) + 1)}
    assert pacer.interval in grid and written[0] == 1
    steps = list(written)
    assert steps[:2] == [0, 1]
    for before, step in zip(steps[1:], steps[2:]):  # each a multiple of the interval chosen at the sample before it
        assert step % written[before] == 0 and written[before] in grid
    assert pacer.expected_share(pacer.interval) <= 0.05 or pacer.interval == MAX_INTERVAL
    assert f"sampling every {written[1]} steps to stay within a 5% overhead budget" in capfd.readouterr().err


# ---------------------------------------------------------------------------------------- memory


def update_ratios(tmp_path, monkeypatch=None, free=None, **options):
    """Every update ratio an Adam-trained 256-wide MLP logs at steps 0, 3, 6: {(step, tag): value}.
    ``free``: the free memory each snapshot finds, in turn (as a GPU's would be)."""
    if free is not None:
        monkeypatch.setattr(params, "free_memory", lambda device: next(free))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ratios = {}
    inspector = Inspector(model, log_dir=tmp_path, optimizer=opt, every_n_steps=3, **options)
    inspector.add_sink(lambda r: ratios.update({(r.step, t): v for t, v in r.scalars.items() if t.startswith("update_ratio")}))
    with inspector:
        train(model, 7, inspector, optimizer=opt, d_in=256)
    return ratios


@pytest.mark.parametrize("bad", [-1, 0.0, -0.5, math.inf, True, "1GB"])
def test_a_bad_memory_budget_names_it(bad):
    with pytest.raises(ValueError, match=f"memory_budget must be .*got {bad!r}"):
        validate_options(memory_budget=bad)


def test_a_snapshot_over_the_memory_budget_estimates_update_ratios_under_their_own_tag(tmp_path, recwarn):
    exact = update_ratios(tmp_path / "exact")
    estimated = update_ratios(tmp_path / "estimated", memory_budget=0.5)  # half the parameters: no whole copy
    assert not [key for key in estimated if key[1].startswith("update_ratio/")]  # never a silent switch
    assert {(step, tag.replace("update_ratio/", "update_ratio_estimate/")) for step, tag in exact} == set(estimated)
    for (step, tag), value in exact.items():
        got = estimated[step, tag.replace("update_ratio/", "update_ratio_estimate/")]
        if tag == "update_ratio/0.weight":  # 65,536 values: a strided sample of ~13,000
            assert got == pytest.approx(value, rel=0.02) and got != pytest.approx(value, rel=1e-6)
        else:  # at most 16,384 values: the sample is the whole weight
            assert got == pytest.approx(value, rel=1e-5)
    said = [w for w in recwarn if "does not fit in memory" in str(w.message)]
    assert len(said) == 1 and "memory_budget=0.5 of 271392 parameter bytes" in str(said[0].message)


def test_a_memory_budget_the_snapshot_fits_keeps_update_ratios_exact(tmp_path, recwarn):
    ratios = update_ratios(tmp_path, memory_budget=271_392)  # the parameters' bytes, to the byte
    assert ratios and all(tag.startswith("update_ratio/") for _, tag in ratios)
    assert not [w for w in recwarn if "does not fit" in str(w.message)]


def test_update_ratios_are_exact_again_when_memory_allows_and_it_is_said(tmp_path, monkeypatch, capfd):
    free = iter([0, 1 << 30, 1 << 30])  # steps 0, 3, 6: as a GPU's free memory comes and goes
    ratios = update_ratios(tmp_path, monkeypatch, free=free)
    assert {step for step, tag in ratios if tag.startswith("update_ratio_estimate/")} == {0}
    assert {step for step, tag in ratios if tag.startswith("update_ratio/")} == {3, 6}
    assert "layerwatch: update ratios are exact again from step 3: the snapshot fits" in capfd.readouterr().err


def test_an_incident_holds_the_interval_and_its_captures_never_more_than_double_it():
    from layerwatch.engine.budget import HOLD_STEPS

    pacer = Pacer(0.01)
    measured(pacer, base_ms=10, own_ms=0, cost_ms=16)
    pacer.interval = pacer.decide()
    assert pacer.interval == 200
    for step in (327, 328, 329):  # a spike's capture of 3 samples, each 300 ms: 0.09 ms a step, over the budget alone
        pacer.unscheduled(step, 0.3)
    assert pacer.ideal() > MAX_INTERVAL
    pacer.sampled(0.016, 0.026, step=400)
    assert pacer.decide() is None  # held: a run in trouble is watched as densely as before
    pacer.sampled(0.016, 0.026, step=329 + HOLD_STEPS)  # the hold is over, the captures still paid for
    assert pacer.decide() is None  # the largest grid value within twice 200 is 200 itself
    pacer.interval = 500
    pacer._before_incidents = 500
    assert pacer.decide() == 1000  # 500 may go to 1,000, never to 10,000


def test_within_the_hold_the_interval_may_shrink_and_after_it_the_runs_own_cost_still_grows_it():
    from layerwatch.engine.budget import HOLD_STEPS

    pacer = Pacer(0.01)
    measured(pacer, base_ms=10, own_ms=0, cost_ms=16)
    pacer.interval = 200
    pacer.incident(300)  # an alert
    measured(pacer, base_ms=10, own_ms=0, cost_ms=1, samples=40)  # samples became cheap: every 20 would do
    pacer.sampled(0.001, 0.011, step=320)
    assert pacer.decide() == 20
    pacer.interval = 20
    measured(pacer, base_ms=10, own_ms=0, cost_ms=160, samples=40)  # ...then dear: its own cost, not an incident's
    pacer.sampled(0.16, 0.17, step=330)
    assert pacer.decide() is None  # held
    pacer.sampled(0.16, 0.17, step=300 + HOLD_STEPS)
    assert pacer.decide() == 2000


def test_a_spike_keeps_the_run_watched_as_densely_as_before(tmp_path, monkeypatch, recwarn):
    """A loss spike's capture samples the next steps, and the interval after it stays where it was,
    though the pacer's ideal (scripted) would now sample every 10,000 steps."""
    current = {"step": 0}
    monkeypatch.setattr(Pacer, "ideal", scripted_ideal(lambda: 15 if current["step"] < 100 else 20_000))
    model = MLP()
    written = {}
    inspector = Inspector(model, log_dir=tmp_path)
    inspector.add_sink(lambda record: written.__setitem__(record.step, record.scalars.get(INTERVAL_TAG)))
    generator = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with inspector:
        for k in range(200):
            current["step"] = k
            x = torch.randn(8, 8, generator=generator)
            loss = model(x).pow(2).mean() * (1000.0 if k == 90 else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            inspector.step(loss=loss)
    assert {91, 92, 93} <= set(written)  # the capture
    assert [k for k in written if k > 93] == [100, 120, 140, 160, 180]  # held at every 20, not 10,000
    assert {written[k] for k in written if k >= 100} == {20}
