"""Faults: the user's exceptions and interrupts pass through unchanged, the writer failing
mid-run, and what was written before any of them stays readable."""

import shutil

import pytest
import torch

from layerwatch import Inspector, InspectCallback
from models import MLP, hook_count, layerwatch_messages, train


class Interrupting(MLP):
    """Raises ``error`` in the forward of call number ``at`` (its hooks are armed then)."""

    def __init__(self, error: BaseException, at: int) -> None:
        super().__init__()
        self.error, self.at, self.calls = error, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return super().forward(x)


def dispatch_modes_active() -> int:
    return torch._C._len_torch_dispatch_stack()


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ValueError("the user's own bug")])
def test_interrupt_or_user_error_mid_forward_passes_through_and_cleans_up(error, tmp_path, events):
    model = Interrupting(error, at=1)  # step 0 is sampled: the layer-table hooks and FlopCounterMode are live
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(type(error)) as info:
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt):
            train(model, 3, optimizer=opt)
    assert info.value is error  # the very same object, unchanged
    assert hook_count(model, opt) == 0 and dispatch_modes_active() == 0
    assert train(model, 2, optimizer=opt)  # the model trains on, free of the inspector


def test_interrupt_after_some_steps_keeps_what_was_written(tmp_path, events):
    model = Interrupting(KeyboardInterrupt(), at=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
            train(model, 6, inspector, optimizer=opt)
    assert hook_count(model, opt) == 0
    assert [e.step for e in events(tmp_path).Scalars("weights_norm/fc1.weight")] == [0, 1, 2]


def test_interrupt_inside_a_trainer(tmp_path, events):
    from models import LitMLP
    from models import make_trainer

    class Interrupted(LitMLP):
        def training_step(self, batch, batch_idx):
            if self.global_step == 3:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    module = Interrupted()
    trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=1)], max_steps=6)
    with pytest.raises((KeyboardInterrupt, SystemExit)):  # Lightning shuts down gracefully, then exits
        trainer.fit(module)
    assert hook_count(module, trainer.optimizers) == 0
    assert [e.step for e in events(trainer.logger.log_dir).Scalars("layerwatch/grad_norm")] == [0, 1, 2]


def run(steps: int, inspector_args=None, *, between=None):
    """Train a fresh MLP for ``steps`` steps, inspected when ``inspector_args`` are given."""
    torch.manual_seed(0)
    model = MLP()
    if not inspector_args:
        return train(model, steps, before_step=between)
    with Inspector(model, **inspector_args) as inspector:
        return train(model, steps, inspector, before_step=between)


def test_log_directory_removed_mid_run(tmp_path):
    log_dir = tmp_path / "run"

    def remove_at_3(k):
        if k == 3:
            shutil.rmtree(log_dir)  # the writer's next write fails: warned once, training goes on

    with pytest.warns(RuntimeWarning, match="could not write the sampled step at step 3: FileNotFoundError") as record:
        losses = run(6, dict(log_dir=log_dir, every_n_steps=1), between=remove_at_3)
    assert losses == run(6)
    assert len(layerwatch_messages(record)) == 1  # warned once, then quiet


def test_writer_failing_mid_run_keeps_earlier_samples_and_training(tmp_path, monkeypatch, events):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    event_file = writer._get_file_writer().event_writer._async_writer._writer._writer  # the open GFile

    def disk_full_from_2(k):
        if k == 2:
            def disk_full(*args, **kwargs):
                raise OSError(28, "No space left on device")

            monkeypatch.setattr(event_file, "write", disk_full)

    with pytest.warns(RuntimeWarning, match="could not write the sampled step at step 2: OSError") as record:
        losses = run(5, dict(writer=writer, every_n_steps=1), between=disk_full_from_2)
    monkeypatch.undo()
    writer.close()
    assert losses == run(5)  # training went on, unchanged
    assert len(layerwatch_messages(record)) == 1  # warned once, then quiet
    assert [e.step for e in events(tmp_path).Scalars("layerwatch/grad_norm")] == [0, 1]  # nothing lost


def test_a_full_disk_at_start_is_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    import torch.utils.tensorboard

    def no_space(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.utils.tensorboard.SummaryWriter, "__init__", no_space)
    torch.manual_seed(0)
    plain = train(MLP(), 4)
    torch.manual_seed(0)
    model = MLP()
    with pytest.warns(RuntimeWarning, match=r"could not open the TensorBoard writer.*No space left on device") as record:
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            assert train(model, 4, inspector) == plain
    assert len(layerwatch_messages(record)) == 1


def test_a_writer_failing_mid_run_prints_no_thread_traceback(tmp_path):
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import shutil, sys
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from models import MLP, train
        from layerwatch import Inspector

        log_dir = {str(tmp_path / "run")!r}
        model = MLP()
        with Inspector(model, log_dir=log_dir, every_n_steps=1, alerts=False) as inspector:
            train(model, 6, inspector, before_step=lambda k: k == 3 and shutil.rmtree(log_dir))
        print("trained")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr
    assert "Traceback" not in out.stderr and "Exception in thread" not in out.stderr, out.stderr
    assert out.stderr.count("RuntimeWarning: layerwatch: could not write") == 1, out.stderr
