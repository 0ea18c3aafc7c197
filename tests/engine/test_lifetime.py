"""An inspector leaves nothing behind: not when finish() is never reached, not when it is
garbage-collected, not when a notebook cell builds a second one on the same model, not at
interpreter exit. Hooks are counted on the optimizer the run really steps."""

import gc
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from layerwatch import Inspector
from models import MLP, hook_count, train


def test_a_forward_that_raises_and_no_finish_leaves_nothing_once_the_inspector_is_gone(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inspector = Inspector(model, log_dir=tmp_path, every_n_steps=10, optimizer=opt).start()  # step 0: armed
    assert hook_count(model, opt) > 0
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model(torch.randn(4, 3))  # the notebook's shape error: no finish(), no with
    assert hook_count(model, opt) == 3  # at once: only the optimizer's (step hooks, the sentinel's count), until finish
    assert "forward" not in vars(model)
    del inspector
    gc.collect()
    assert hook_count(model, opt) == 0
    assert gc.isenabled()


def test_a_forgotten_finish_after_the_last_step_leaves_nothing_once_the_inspector_is_gone(tmp_path, events):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inspector = Inspector(model, log_dir=tmp_path, every_n_steps=2, optimizer=opt).start()
    train(model, 4, inspector, optimizer=opt)  # the last step() armed step 4
    assert hook_count(model, opt) > 2
    del inspector
    gc.collect()
    assert hook_count(model, opt) == 0
    plain_steps = train(model, 3, optimizer=opt)  # and the model trains on, unobserved
    assert len(plain_steps) == 3
    assert [e.step for e in events(tmp_path).Scalars("weights_norm/fc1.weight")] == [0, 2]  # the writer was flushed


def test_a_cell_run_twice_does_not_stack_hooks(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = Inspector(model, log_dir=tmp_path / "a", every_n_steps=1, optimizer=opt).start()
    armed_once = hook_count(model, opt)
    with pytest.warns(RuntimeWarning, match="still watched by an earlier Inspector"):
        second = Inspector(model, log_dir=tmp_path / "b", every_n_steps=1, optimizer=opt).start()
    assert hook_count(model, opt) == armed_once  # the first one's hooks are gone, the second's armed
    with pytest.raises(RuntimeError, match="finished"):
        first.step()
    train(model, 2, second, optimizer=opt)
    second.finish()
    assert hook_count(model, opt) == 0


def test_finished_inspectors_are_not_warned_about(tmp_path):
    model = MLP()
    with Inspector(model, log_dir=tmp_path / "a", every_n_steps=1) as inspector:
        train(model, 1, inspector)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Inspector(model, log_dir=tmp_path / "b", every_n_steps=1).start().finish()


def test_nothing_is_left_at_interpreter_exit(tmp_path):
    script = textwrap.dedent(f"""
        import sys, weakref, torch
        sys.path.insert(0, {str(tmp_path.parent)!r})
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parents[1])!r})
        from models import MLP, hook_count, train
        from layerwatch import Inspector

        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # exit handlers of weakref.finalize run newest first: this one, older, runs after the inspector's
        keep = type("Keep", (), {{}})()
        weakref.finalize(keep, lambda: print("hooks at exit:", hook_count(model, opt)))
        inspector = Inspector(model, log_dir={str(tmp_path)!r}, every_n_steps=2, optimizer=opt).start()
        train(model, 3, inspector, optimizer=opt)
        print("hooks while running:", hook_count(model, opt))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "hooks at exit: 0" in out.stdout and "hooks while running: 0" not in out.stdout, out.stdout


def test_the_collector_clock_is_there_during_a_sampled_step_only(tmp_path):
    before = list(gc.callbacks)
    model = MLP()
    seen = []
    with Inspector(model, log_dir=tmp_path, every_n_steps=2) as inspector:
        for step in range(4):
            train(model, 1)
            seen.append(len(gc.callbacks) - len(before))
            inspector.step()  # closes this step, opens the next
    # steps 0 and 2 are sampled: the clock is attached from their start to their end
    assert seen == [1, 0, 1, 0]
    assert gc.callbacks == before  # finish() took step 4's off


def test_a_step_abandoned_by_an_exception_leaves_no_collector_clock(tmp_path):
    before = list(gc.callbacks)
    model = MLP()
    inspector = Inspector(model, log_dir=tmp_path, every_n_steps=1).start()
    train(model, 1)  # step 0 is open and sampled; the loop dies here
    assert len(gc.callbacks) == len(before) + 1
    del inspector
    gc.collect()
    assert gc.callbacks == before


@pytest.mark.parametrize("first", ["lower", "upper"])
def test_stacked_forward_guards_come_off_in_either_order_and_both_see_a_failure(first):
    """A run-long guard (the Hugging Face door's input hook) under a sampled step's guard: each
    runs its ``on_failure`` when the forward raises, and removing them in any order leaves the
    model's ``forward`` as it was."""
    from layerwatch.guards.hooks import FailedForwardGuard

    model = nn.Linear(2, 2)
    failed: list[str] = []
    lower = FailedForwardGuard(model, lambda: failed.append("lower"))
    upper = FailedForwardGuard(model, lambda: failed.append("upper"))
    with pytest.raises(RuntimeError):
        model(torch.ones(3))  # a shape error
    assert failed == ["lower", "upper"]
    guards = (lower, upper) if first == "lower" else (upper, lower)
    guards[0].remove()
    assert model(torch.ones(1, 2)).shape == (1, 2)  # the other guard still calls through
    guards[1].remove()
    guards[1].remove()  # safe twice
    assert "forward" not in vars(model)
