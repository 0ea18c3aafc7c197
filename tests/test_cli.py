import subprocess
import sys
from pathlib import Path

import pytest

from layerwatch.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_writes_logs_and_shows_an_injected_nan(tmp_path, events, capsys):
    log_dir = tmp_path / "demo"
    assert main(["demo", "--steps", "40", "--every", "10", "--logdir", str(log_dir), "--inject-nan", "25"]) == 0
    out = capsys.readouterr().out
    assert f"tensorboard --logdir {log_dir}" in out
    acc = events(log_dir / "demo" / "version_0")
    assert "train/loss" in acc.Tags()["scalars"]  # the module's own metrics, same run
    nonfinite = {e.step: e.value for e in acc.Scalars("weights_nonfinite/encoder.0.weight")}
    assert nonfinite[0] == 0 and nonfinite[20] == 0
    assert nonfinite[30] > 0  # the NaN from step 25's forward reached the weights through Adam
    # The sentinel saw step 25's NaN gradients and had step 26 sampled with every probe armed.
    assert [(e.step, e.value) for e in acc.Scalars("layerwatch/first_nonfinite_step")] == [(25, 25.0)]
    assert [e.step for e in acc.Scalars("layerwatch/grad_norm")] == [0, 10, 20, 26, 30]
    (offender,) = acc.Tensors("layerwatch/first_offender/text_summary")
    assert offender.step == 26  # Adam spread the NaN into every weight: the first layer is the first to use one
    assert "forward: encoder.0 turned finite inputs" in offender.tensor_proto.string_val[0].decode()
    alerts = acc.Tensors("layerwatch/alerts/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| nonfinite | encoder.0 | 26 | first offender" in alerts and "stuck" not in alerts and "dead" not in alerts
    assert "layerwatch report" in out


@pytest.mark.parametrize("argv, message", [(["demo", "--steps", "0"], "must be >= 1, got 0"),
                                            (["demo", "--every", "-2"], "must be >= 1, got -2")])
def test_demo_refuses_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_python_dash_m_and_example_script_run(tmp_path, events):
    version = subprocess.run([sys.executable, "-m", "layerwatch", "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("layerwatch ")
    subprocess.run([sys.executable, str(ROOT / "examples" / "plain_pytorch.py")], cwd=tmp_path, check=True,
                   capture_output=True)
    acc = events(tmp_path / "runs" / "plain_pytorch")
    steps = [e.step for e in acc.Scalars("layerwatch/grad_norm")]
    assert steps[:20] == list(range(20)) and steps[20:] == [25, 50, 75, 100, 125, 150, 175, 200, 225, 250, 275]
    assert "update_ratio/0.weight" in acc.Tags()["scalars"]
