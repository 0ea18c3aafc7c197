import pytest

from layerwatch.schedule import Schedule, as_schedule, at_steps, dense_then_every, every_n_steps, windowed


def sampled(schedule, n=20):
    return [k for k in range(n) if schedule(k)]


def test_every_n_steps_samples_multiples_from_zero():
    assert sampled(every_n_steps(5)) == [0, 5, 10, 15]
    assert sampled(every_n_steps(1), 4) == [0, 1, 2, 3]


def test_at_steps_and_callable_and_int():
    assert sampled(at_steps([3, 7, 7, 100])) == [3, 7]
    assert sampled(as_schedule(lambda k: k in (2, 4))) == [2, 4]
    assert sampled(as_schedule(4)) == [0, 4, 8, 12, 16]
    assert sampled(as_schedule([1, 2])) == [1, 2]


def test_windowed_matches_profiler_cycle():
    s = windowed(wait=2, warmup=1, active=2, repeat=2, skip_first=1)
    # skip step 0; cycles of 5 starting at 1: sampled at offsets 3, 4 -> steps 4, 5, 9, 10; then stops.
    assert sampled(s) == [4, 5, 9, 10]
    assert sampled(windowed(wait=1, active=1), 6) == [1, 3, 5]


def test_dense_then_every():
    assert sampled(dense_then_every(first=3, every=10), 25) == [0, 1, 2, 10, 20]


def test_repr_names_the_schedule():
    assert repr(every_n_steps(50)) == "every_n_steps(50)"
    assert "dense_then_every(first=3, every=10)" == repr(dense_then_every(3, 10))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: every_n_steps(0), r"every_n_steps must be an int >= 1, got 0"),
        (lambda: every_n_steps(2.5), r"got 2.5"),
        (lambda: at_steps([1, -3]), r"got -3"),
        (lambda: windowed(wait=1, active=0), r"active must be an int >= 1, got 0"),
        (lambda: dense_then_every(first=-1, every=5), r"first must be an int >= 0, got -1"),
    ],
)
def test_bad_arguments_name_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_as_schedule_rejects_strings():
    with pytest.raises(TypeError, match="'often'"):
        as_schedule("often")
    assert isinstance(as_schedule(every_n_steps(3)), Schedule)


def test_schedules_pickle_for_spawned_processes():
    import pickle

    for schedule in (every_n_steps(3), at_steps([1, 5]), windowed(wait=1, active=2, repeat=1), dense_then_every(2, 4)):
        clone = pickle.loads(pickle.dumps(schedule))
        assert sampled(clone) == sampled(schedule) and repr(clone) == repr(schedule)


def test_a_schedule_callable_returning_anything_but_a_bool_is_refused_at_the_first_step(tmp_path):
    import torch

    from layerwatch import Inspector

    with pytest.raises(TypeError, match=r"callable\(forgot_return\) must return a bool.*returned None for step 0"):
        def forgot_return(step):
            step % 10 == 0

        Inspector(torch.nn.Linear(2, 2), log_dir=tmp_path, schedule=forgot_return).start()


def test_a_schedule_callable_that_raises_is_named_at_the_first_step_and_skipped_later(tmp_path):
    import warnings

    import torch

    from layerwatch import Inspector
    from models import MLP, train

    def broken(step):
        return 1 / 0

    with pytest.raises(ValueError, match=r"schedule callable\(broken\) failed for step 0: ZeroDivisionError"):
        Inspector(torch.nn.Linear(2, 2), log_dir=tmp_path / "a", schedule=broken).start()

    def breaks_at_3(step):
        if step == 3:
            raise KeyError(step)
        return True

    torch.manual_seed(0)
    plain = train(MLP(), 5)
    torch.manual_seed(0)
    model = MLP()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=tmp_path / "b", schedule=breaks_at_3, alerts=False) as inspector:
            assert train(model, 5, inspector) == plain  # the run goes on, unchanged
    failures = [str(w.message) for w in seen if "failed for step 3" in str(w.message)]
    assert len(failures) == 1 and "KeyError(3)" in failures[0]
