"""Which steps are sampled (:class:`layerwatch.engine.sampling.Sampling`), tested on its own: the
schedule's answers, a fault's request, the ranks' groups in a single process, and the overhead
budget's cost, interval and state."""

from __future__ import annotations

import logging
import types
import warnings

import pytest

from layerwatch.engine import sampling as sampling_module
from layerwatch.guards.failures import FailurePolicy
from layerwatch.guards.hooks import Attachments
from layerwatch.options import validate_options
from layerwatch.engine.sampling import EXCESS_LIMIT, Sampling
from layerwatch.schedule import at_steps


class NoFindings:
    """The sentinel's side of the vote, with nothing to vote on: records what it hears."""

    def __init__(self) -> None:
        self.voted = []

    def unvoted(self):
        return None

    def on_voted(self, decision, step):
        self.voted.append((decision, step))


class Clock:
    """A ``time`` module whose ``perf_counter`` reads ``now``, set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(sampling_module, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def fixed(schedule, **options):
    return Sampling(validate_options(schedule=schedule, **options), FailurePolicy())


def budgeted(budget=0.01):
    return Sampling(validate_options(overhead_budget=budget), FailurePolicy())


def decisions(sampling, steps, may_sample=True, findings=None):
    findings = findings or NoFindings()
    return [sampling.decide(step, may_sample, findings) for step in steps]


def runtime_warnings(action):
    """``action()``'s RuntimeWarnings' messages, every one of them (none filtered as repeated)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# ---------------------------------------------------------------------- the schedule's answers


def test_a_fixed_schedule_samples_exactly_its_steps_in_a_single_process():
    findings = NoFindings()
    sampling = fixed(3)
    assert sampling.vote is None and sampling.pacer is None
    assert decisions(sampling, range(10), findings=findings) == [k % 3 == 0 for k in range(10)]
    assert findings.voted == []  # no vote in a single process: nothing is heard


def test_a_step_that_may_not_be_sampled_is_not_even_when_scheduled():
    sampling = fixed(2)
    assert sampling.decide(0, False, NoFindings()) is False
    assert sampling.decide(2, False, NoFindings()) is False
    assert sampling.decide(4, True, NoFindings()) is True


def test_ask_forces_the_next_step_once_and_only_once():
    sampling = fixed(at_steps([0]))
    assert decisions(sampling, [0, 1, 2]) == [True, False, False]
    sampling.ask()
    assert decisions(sampling, [3, 4, 5]) == [True, False, False]


def test_a_forced_sample_survives_a_step_that_may_not_be_sampled():
    sampling = fixed(at_steps([0]))
    sampling.ask()
    assert sampling.decide(1, False, NoFindings()) is False
    assert sampling.decide(2, False, NoFindings()) is False
    assert decisions(sampling, [3, 4]) == [True, False]


def test_asking_twice_before_a_sample_still_forces_one_step():
    sampling = fixed(at_steps([100]))
    sampling.ask()
    sampling.ask()
    assert decisions(sampling, [1, 2, 3]) == [True, False, False]


# ---------------------------------------------------------------------- the schedule's check


@pytest.mark.parametrize("error", [ValueError("bad step"), RuntimeError("no config")])
def test_a_schedule_failing_on_its_first_call_raises_a_value_error_naming_it_and_the_step(error):
    def flaky(step):
        raise error

    sampling = fixed(flaky)
    with pytest.raises(ValueError, match=rf"schedule callable\(flaky\) failed for step 7: {type(error).__name__}: ") as info:
        sampling.decide(7, True, NoFindings())
    assert info.value.__cause__ is error


def test_a_type_error_of_the_schedules_first_call_is_raised_as_is():
    error = TypeError("step must be a str")

    def typed(step):
        raise error

    with pytest.raises(TypeError) as info:
        fixed(typed).decide(0, True, NoFindings())
    assert info.value is error


def test_a_schedule_returning_no_bool_on_its_first_call_raises_its_type_error():
    with pytest.raises(TypeError, match=r"schedule callable\(<lambda>\) must return a bool .* returned None for step 0"):
        fixed(lambda step: None).decide(0, True, NoFindings())


def test_a_schedule_failing_after_its_check_is_warned_once_and_its_steps_are_not_sampled():
    def breaks_after_two(step):
        if step >= 2:
            raise RuntimeError(f"broken at {step}")
        return True

    sampling = fixed(breaks_after_two)
    out = []
    messages = runtime_warnings(lambda: out.extend(decisions(sampling, range(5))))
    assert out == [True, True, False, False, False]
    assert len(messages) == 1
    assert messages[0].startswith("layerwatch: schedule callable(breaks_after_two) failed for step 2: RuntimeError")
    assert messages[0].endswith("such steps are not sampled")


def test_a_failed_check_is_made_again_at_the_next_call():
    calls = []

    def fails_once(step):
        calls.append(step)
        if len(calls) == 1:
            raise ValueError("first")
        return True

    sampling = fixed(fails_once)
    with pytest.raises(ValueError, match="failed for step 0"):
        sampling.decide(0, True, NoFindings())
    assert sampling.decide(1, True, NoFindings()) is True
    assert calls == [0, 1]


# ---------------------------------------------------------------------- the ranks' groups


def test_opening_groups_apart_in_a_single_process_leaves_no_vote_and_follows_the_schedule():
    sampling = fixed(2)
    attached = Attachments()
    assert runtime_warnings(lambda: sampling.open_groups(False, attached)) == []
    assert sampling.vote is None and sampling.sync is None
    assert attached.removables == []
    assert decisions(sampling, range(4)) == [True, False, True, False]


def test_ranks_that_must_sample_together_without_a_process_group_sample_nothing_and_say_why_once():
    """Without torch.distributed, the ranks' group cannot be made: no step is sampled, not even one asked for."""
    sampling = fixed(1)
    attached = Attachments()
    messages = runtime_warnings(lambda: sampling.open_groups(True, attached))
    assert len(messages) == 1
    assert messages[0].startswith("layerwatch: could not make the ranks' group for agreeing (no step is sampled) at step 0")
    assert sampling.vote is None and attached.removables == []
    sampling.ask()
    findings = NoFindings()
    assert decisions(sampling, range(4), findings=findings) == [False] * 4
    assert findings.voted == []


def test_a_budget_in_a_single_process_keeps_its_pacer_when_the_groups_open():
    sampling = budgeted()
    sampling.open_groups(False, Attachments())
    assert sampling.pacer is not None and sampling.schedule is sampling.pacer
    sampling.close()
    assert sampling.vote is None and sampling.sync is None


# ---------------------------------------------------------------------- the overhead budget's cost


def unsampled_steps(sampling, clock, count, wall_s=1.0, start=0.0):
    """``count`` unsampled steps of ``wall_s`` each, from ``start`` on the clock."""
    for i in range(count):
        clock.now = start + 10.0 * i
        sampling.open()
        clock.now += wall_s
        sampling.close_unsampled(i, clock.now, 0.0)


def sampled_step_cost(sampling, clock, step_s, measured_s=0.1, own_s=0.1, collected_s=0.05, at=1000.0):
    """The cost of a step that opens at ``at`` and runs ``step_s``: ``measured_s`` in our timers,
    and ``own_s`` since ``started``."""
    clock.now = at
    sampling.open()
    clock.now = at + step_s
    return sampling.cost(7, measured_s, clock.now - own_s, collected_s)


def test_the_cost_is_the_measured_time_until_three_unsampled_steps_are_seen(clock):
    sampling = fixed(1)
    unsampled_steps(sampling, clock, 2)
    cost_s, interval = sampled_step_cost(sampling, clock, step_s=50.0)
    assert cost_s == pytest.approx(0.2)  # measured_s + own_s, however long the step
    assert interval is None  # a fixed schedule has no interval to choose


def test_the_cost_counts_the_previous_writes_duration_in_the_measured_time(clock):
    sampling = fixed(1)
    sampling.wrote(0.3)
    cost_s, _ = sampled_step_cost(sampling, clock, step_s=50.0)
    assert cost_s == pytest.approx(0.5)


def test_the_excess_over_the_unsampled_neighbours_is_bounded_by_the_excess_limit_and_the_collector(clock):
    sampling = fixed(1)
    unsampled_steps(sampling, clock, 3, wall_s=1.0)
    cost_s, _ = sampled_step_cost(sampling, clock, step_s=50.0, measured_s=0.1, own_s=0.1, collected_s=0.05)
    assert cost_s == pytest.approx((1 + EXCESS_LIMIT) * 0.2 + 0.05)


def test_an_excess_within_the_limit_counts_in_full(clock):
    sampling = fixed(1)
    unsampled_steps(sampling, clock, 5, wall_s=1.0)
    cost_s, _ = sampled_step_cost(sampling, clock, step_s=1.4, measured_s=0.1, own_s=0.1, collected_s=0.0)
    assert cost_s == pytest.approx(0.4)  # the step's 1.4 s less its neighbours' median 1.0 s


def test_the_cost_is_never_less_than_the_measured_time(clock):
    sampling = fixed(1)
    unsampled_steps(sampling, clock, 3, wall_s=1.0)
    cost_s, _ = sampled_step_cost(sampling, clock, step_s=0.5, measured_s=0.1, own_s=0.1)
    assert cost_s == pytest.approx(0.2)


def test_the_neighbours_median_ignores_one_unusually_long_unsampled_step(clock):
    sampling = fixed(1)
    unsampled_steps(sampling, clock, 3, wall_s=1.0)
    unsampled_steps(sampling, clock, 1, wall_s=30.0, start=100.0)
    cost_s, _ = sampled_step_cost(sampling, clock, step_s=1.3, measured_s=0.1, own_s=0.1, collected_s=0.0)
    assert cost_s == pytest.approx(0.3)


# ---------------------------------------------------------------------- the budget's interval


def budget_chooses_an_interval(sampling, clock, steps=(0, 1)):
    """Two sampled steps (the first pays one-off costs and is left out): the second costs 0.1 s
    of a 1 s step, which a 1% budget spreads over 20 steps. Returns the intervals cost gave."""
    first_step, second_step = steps
    clock.now = 0.0
    sampling.open()
    clock.now = 1.0
    _, first = sampling.cost(first_step, 0.0, 0.0, 0.0)
    sampling.close_sampled(first_step)
    clock.now = 2.0
    sampling.open()
    clock.now = 3.0
    _, second = sampling.cost(second_step, 0.0, 2.9, 0.0)
    return first, second


def test_the_budget_samples_every_step_until_it_chooses_an_interval():
    sampling = budgeted()
    assert sampling.state_dict() == {}
    assert decisions(sampling, range(5)) == [True] * 5


def test_share_interval_in_a_single_process_adopts_the_proposed_interval_and_says_so_once(clock, caplog, capsys):
    caplog.set_level(logging.INFO, logger="layerwatch")
    sampling = budgeted(0.01)
    assert budget_chooses_an_interval(sampling, clock) == (1, 20)
    assert sampling.pacer.interval is None  # proposed, not shared yet
    sampling.close_sampled(1)  # the budget scheduled step 1: the interval is shared there
    sampling.share_interval(20)
    sampling.close_sampled(40)
    message = "layerwatch: sampling every 20 steps to stay within a 1% overhead budget; pass every_n_steps= to fix the interval"
    assert capsys.readouterr().err.splitlines() == [message]
    assert [r.getMessage() for r in caplog.records if r.name == "layerwatch"] == [message]
    assert sampling.pacer.interval == 20
    assert sampling.state_dict() == {"sample_interval": 20}
    assert decisions(sampling, [40, 41, 59, 60]) == [True, False, False, True]


def test_an_interval_proposed_again_unchanged_is_not_said_again(clock, capsys):
    sampling = budgeted(0.01)
    sampling.load_state_dict({"sample_interval": 20})
    assert budget_chooses_an_interval(sampling, clock, steps=(0, 20)) == (20, 20)
    sampling.close_sampled(20)
    assert capsys.readouterr().err == ""
    assert sampling.pacer.interval == 20


# ---------------------------------------------------------------------- state


def test_the_budgets_interval_round_trips_through_the_state_dict():
    sampling = budgeted()
    sampling.load_state_dict({"sample_interval": 50})
    state = sampling.state_dict()
    assert state == {"sample_interval": 50}
    resumed = budgeted()
    resumed.load_state_dict(state)
    assert resumed.pacer.interval == 50
    assert decisions(resumed, [0, 1, 49, 50, 100]) == [True, False, False, True, True]


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "5"])
def test_loading_an_interval_that_is_not_a_positive_int_raises_naming_it(bad):
    with pytest.raises(ValueError, match=rf"state\['sample_interval'\] must be an int >= 1, got {bad!r}"):
        budgeted().load_state_dict({"sample_interval": bad})


def test_a_state_without_an_interval_is_loaded_as_nothing():
    sampling = budgeted()
    sampling.load_state_dict({})
    assert sampling.pacer.interval is None and sampling.state_dict() == {}


def test_a_fixed_schedule_has_an_empty_state_and_ignores_a_loaded_interval():
    sampling = fixed(3)
    assert sampling.state_dict() == {}
    sampling.load_state_dict({"sample_interval": 7})
    assert sampling.state_dict() == {}
    assert decisions(sampling, range(8)) == [k % 3 == 0 for k in range(8)]


def test_a_fixed_schedule_still_refuses_a_bad_loaded_interval():
    with pytest.raises(ValueError, match="got 0"):
        fixed(3).load_state_dict({"sample_interval": 0})


def test_the_checks_count_as_measured_once_the_budget_has_measured_them_and_always_without_a_budget(clock):
    """The sentinel's wait for a replay (a device sync) waits for this: see Faults.check."""
    assert fixed(1).checks_measured
    sampling = budgeted(0.01)
    unsampled_steps(sampling, clock, 5)
    assert not sampling.checks_measured and sampling.sentinel_spread == 1
    unsampled_steps(sampling, clock, 17)  # steps 8 and 16 ask the pacer: cheap checks, left whole
    assert sampling.checks_measured and sampling.sentinel_spread == 1


def test_the_checks_count_as_measured_once_the_ranks_fall_back_to_a_fixed_interval():
    sampling = budgeted(0.01)
    assert not sampling.checks_measured
    sampling.pacer = None  # as open_groups does when the ranks cannot share an interval
    assert sampling.checks_measured
