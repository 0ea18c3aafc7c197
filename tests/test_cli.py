import subprocess
import sys
from pathlib import Path

import pytest

from layerwatch.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_writes_logs_and_names_the_layer_that_injected_a_nan(tmp_path, events, capsys):
    log_dir = tmp_path / "demo"
    assert main(["demo", "--steps", "40", "--every", "10", "--logdir", str(log_dir), "--inject-nan", "25"]) == 0
    out = capsys.readouterr().out
    assert f"tensorboard --logdir {log_dir}" in out
    assert ("a NaN was injected at step 25 (between samples) by layer encoder.fault (its first unit's output); "
            "layerwatch's first offender: step 25, forward: encoder.fault turned finite inputs into a non-finite output "
            "(replayed from step 25)") in out
    acc = events(log_dir / "demo" / "version_0")
    assert "train/loss" in acc.Tags()["scalars"]  # the module's own metrics, same run
    # Read after step 25's update: Adam spread the NaN into every weight.
    assert {e.step for e in acc.Scalars("weights_nonfinite/encoder.0.weight") if e.value > 0} == {25, 30}
    # Step 25 is not scheduled: the sentinel saw its NaN gradients before Adam's step, and its batch was
    # replayed; the step is recorded with what the replay's probes saw, and no later step is forced.
    assert [(e.step, e.value) for e in acc.Scalars("layerwatch/first_nonfinite_step")] == [(25, 25.0)]
    assert [e.step for e in acc.Scalars("layerwatch/grad_norm")] == [0, 10, 20, 25, 30]
    assert {e.step: e.value for e in acc.Scalars("nonfinite/encoder.fault")}[25] == 1.0
    (offender,) = acc.Tensors("layerwatch/first_offender/text_summary")
    assert offender.step == 25
    assert offender.tensor_proto.string_val[0].decode() == (
        "step 25, forward: encoder.fault turned finite inputs into a non-finite output (replayed from step 25)"
    )
    alerts = acc.Tensors("layerwatch/alerts/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| nonfinite | encoder.fault | 25 | first offender" in alerts
    assert "stuck" not in alerts and "dead" not in alerts
    assert "layerwatch report" in out
    assert main(["report", str(log_dir)]) == 0
    report = capsys.readouterr().out
    assert "nonfinite  encoder.fault: first offender: step 25" in report and "First non-finite: step 25 in" in report
    assert "(replayed from step 25)" in report


def test_the_demos_progress_bar_names_its_last_epoch_and_the_run_still_ends_at_steps(tmp_path, events, capsys):
    import importlib.util
    import re

    from layerwatch.demo import run_demo

    # 20,000 samples in batches of 10,000: two steps an epoch, so 5 steps end in epoch 2 (of 0..2).
    run_dir = run_demo(steps=5, log_dir=str(tmp_path / "demo"), every=1, batch=10_000)
    out = capsys.readouterr().out
    assert not re.search(r"Epoch \d+/-", out)  # Lightning's bar for a run without max_epochs: "Epoch 2/-2"
    rich = importlib.util.find_spec("rich") is not None  # Lightning's Rich bar names the last epoch; tqdm's does not
    assert re.search(r"Epoch 2/2\b" if rich else r"Epoch 2\b", out), out
    assert [e.step for e in events(run_dir).Scalars("layerwatch/grad_norm")] == [0, 1, 2, 3, 4]  # every step, no more


def test_the_demo_fault_layer_is_the_identity_until_it_fires():
    import torch
    from torch import nn

    from layerwatch.demo import FAULT, DemoModule, FaultInjector

    layer = FaultInjector()
    x = torch.randn(3, 5)
    assert layer(x) is x
    layer.fire = True
    fired = layer(x)
    assert torch.isnan(fired[:, 0]).all() and torch.equal(fired[:, 1:], x[:, 1:])
    torch.manual_seed(0)
    model = DemoModule(inject_nan=3).train()
    torch.manual_seed(0)  # the numbered layers, built in the same order from the same seed
    plain = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    assert [n for n, _ in model.named_parameters()] == [f"encoder.{n}" for n, _ in plain[:6].named_parameters()] + [
        "head.weight", "head.bias"]
    assert FAULT in dict(model.named_modules())
    x = torch.randn(8, 32)
    assert torch.equal(model(x), plain(x))  # bitwise: no injection at step 0


@pytest.mark.parametrize("argv, message", [
    (["demo", "--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
    (["demo", "--steps", "abc"], "argument --steps: expected a positive integer, got 'abc'"),
    (["demo", "--every", "-2"], "argument --every: expected a positive integer, got '-2'"),
    (["demo", "--every", "1.5"], "argument --every: expected a positive integer, got '1.5'"),
    (["demo", "--inject-nan", "x"], "argument --inject-nan: expected a step number (an integer >= 0), got 'x'"),
    (["demo", "--steps", "40", "--inject-nan", "40"],
     "argument --inject-nan: step 40 is outside the run; choose a step in 0..39 (--steps 40)"),
    (["demo", "--steps", "40", "--inject-nan", "-1"],
     "argument --inject-nan: step -1 is outside the run; choose a step in 0..39 (--steps 40)"),
    (["demo", "--inject-nan", "8000"],
     "argument --inject-nan: step 8000 is outside the run; choose a step in 0..7999 (--steps 8000)"),
])
def test_demo_refuses_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.splitlines()[-1] == f"layerwatch demo: error: {message}"


def test_demo_refuses_a_logdir_it_cannot_write_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "logs"
    done = subprocess.run([sys.executable, "-m", "layerwatch", "demo", "--steps", "5", "--logdir", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"layerwatch demo: error: argument --logdir: cannot create or write to {str(bad)!r}: Not a directory"
    )


def test_run_demo_refuses_a_step_outside_the_run_before_training(tmp_path):
    from layerwatch.demo import run_demo

    for step in (40, -1):
        with pytest.raises(ValueError, match=rf"inject_nan must be a step of the run, an int in 0\.\.39 \(steps=40\), "
                                             rf"got {step}$"):
            run_demo(steps=40, log_dir=str(tmp_path / "demo"), inject_nan=step)
    with pytest.raises(ValueError, match=r"every must be an int >= 1, got 0"):
        run_demo(steps=40, log_dir=str(tmp_path / "demo"), every=0)
    assert not (tmp_path / "demo").exists()  # refused before anything was written
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a writable directory"):
        run_demo(steps=40, log_dir=str(tmp_path / "file"))


def test_summary_refuses_an_input_it_cannot_allocate(capsys):
    with pytest.raises(SystemExit) as info:
        main(["summary", "torch.nn:Identity", "--input", "100000x100000x100000"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "layerwatch summary: error: --input '100000x100000x100000': cannot make this tensor: " in err


def test_python_dash_m_and_example_script_run(tmp_path, events):
    version = subprocess.run([sys.executable, "-m", "layerwatch", "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("layerwatch ")
    subprocess.run([sys.executable, str(ROOT / "examples" / "plain_pytorch.py")], cwd=tmp_path, check=True,
                   capture_output=True)
    acc = events(tmp_path / "runs" / "plain_pytorch")
    steps = [e.step for e in acc.Scalars("layerwatch/grad_norm")]
    assert steps[:20] == list(range(20)) and steps[20:] == [25, 50, 75, 100, 125, 150, 175, 200, 225, 250, 275]
    assert "update_ratio/0.weight" in acc.Tags()["scalars"]
