"""``layerwatch report``: how it reads (units, factors, columns) and what it says of a log
directory without layerwatch data."""

import json
import subprocess
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

from layerwatch.cli import main
from layerwatch.reading.report import NAME_WIDTH, _bytes, _factor, _fit

LONG = "model.decoder.layers.11.self_attention.rotary_embedding.inner_projection_with_a_long_name.weight"


def write_run(path, series):
    """``series``: tag -> the value at each step."""
    writer = SummaryWriter(str(path))
    for tag, values in series.items():
        for step, value in enumerate(values):
            writer.add_scalar(tag, value, step)
    writer.close()


@pytest.mark.parametrize("value, text", [(0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                         (1536, "1.5 KiB"), (1.5 * 2**20, "1.5 MiB"), (1023.99 * 1024, "1.0 MiB"),
                                         (3 * 2**30, "3.0 GiB"), (5 * 2**40, "5.0 TiB"), (2**52, "4096.0 TiB")])
def test_bytes_in_binary_units(value, text):
    assert _bytes(value) == text


@pytest.mark.parametrize("factor, text", [(1.0, "×1"), (2.5, "×2.5"), (1.28, "×1.28"), (0.25, "÷4"),
                                          (1 / 312_000, "÷312,000"), (3.2e-6, "÷312,500"), (150.0, "×150"),
                                          (8.2e4, "×82,000"), (1.2e7, "×1.2e7"), (1 / 4.5e9, "÷4.5e9")])
def test_factors_read_as_times_or_divided_by(factor, text):
    assert _factor(factor) == text


def test_long_names_keep_their_start_and_end():
    short = _fit(LONG)
    assert len(short) == NAME_WIDTH and "…" in short
    head, tail = short.split("…")
    assert LONG.startswith(head) and LONG.endswith(tail) and tail.endswith("with_a_long_name.weight")
    assert _fit("encoder.0.weight") == "encoder.0.weight"


def test_report_text_units_factors_and_columns(tmp_path, capsys):
    write_run(tmp_path, {
        f"weights_norm/{LONG}": [1.0, 2.0, 4.0],
        "weights_norm/fc.weight": [2.0, 2.0, 2.0],
        "grads_norm/fc.weight": [3.2, 1e-3, 1e-5],  # shrank 320,000 times
        "activation_bytes/enc": [1.5 * 2**20] * 3,
        "saved_bytes/enc": [0.0] * 3,
        "activation_bytes/head": [512.0] * 3,
        "fwd_ms/enc": [12.25] * 3,
        "fwd_ms/head": [0.5] * 3,
    })
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "No layerwatch data" not in out and "e-0" not in out and "x," not in out
    memory = out.split("Largest memory, leaf layers (median bytes):\n")[1].splitlines()[:2]
    assert memory == ["  enc   1.5 MiB", "  head    512 B"]
    slowest = out.split("Slowest leaf layers (median fwd + bwd):\n")[1].splitlines()[:2]
    assert slowest == ["  enc    12.2 ms", "  head  0.500 ms"]
    changing = out.split("Fastest-changing gradient norms (first to last sample):\n")[1].splitlines()[0]
    assert changing.split() == ["fc.weight", "3.2", "->", "1e-5", "÷320,000", "(steps", "0..2)"]
    largest = out.split("Largest weight norms (last sample):\n")[1].splitlines()[:2]
    assert largest[0].startswith("  " + _fit(LONG) + "  ")
    # One column for the values, as wide as the longest (shortened) name in the table.
    assert [line.index(" 4  (step 2)") for line in largest[:1]] == [line.index(" 2  (step 2)") for line in largest[1:]]
    assert all(len(line) < NAME_WIDTH + 30 for line in largest)


def test_report_json_keeps_raw_numbers(tmp_path, capsys):
    write_run(tmp_path, {"grads_norm/fc.weight": [3.2, 1e-5], "activation_bytes/enc": [1.5 * 2**20] * 2})
    assert main(["report", str(tmp_path), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["largest_memory"] == [{"name": "enc", "bytes": 1.5 * 2**20}]
    assert run["grads"]["fastest_changing"][0]["factor"] == pytest.approx(1e-5 / 3.2)
    assert run["layerwatch_data"] is True and run["other_tags"] == []


def test_a_logdir_without_layerwatch_data_says_so_and_fails_the_gate(tmp_path, capsys):
    write_run(tmp_path / "plain", {"loss": [1.0, 0.5], "accuracy": [0.1, 0.9]})
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"No layerwatch data in {tmp_path}: its event files hold none of layerwatch's tags" in out
    assert "== plain: no layerwatch data (other writers' tags only: accuracy, loss)" in out
    assert "Alerts: none" not in out
    for argv in (["--fail-on", "any"], ["--fail-on", "nonfinite", "--json"]):
        assert main(["report", str(tmp_path), *argv]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip() == (
            f"layerwatch report: no layerwatch data in {str(tmp_path)!r} (1 run(s) with other writers' tags only); "
            f"cannot judge --fail-on {argv[1]}"
        )
    (run,) = json.loads(captured.out)["runs"]
    assert run["layerwatch_data"] is False and run["other_tags"] == ["accuracy", "loss"]


def test_the_gate_judges_the_runs_that_hold_layerwatch_data(tmp_path, capsys):
    write_run(tmp_path / "plain", {"loss": [1.0, 0.5]})
    write_run(tmp_path / "watched", {"weights_norm/fc.weight": [1.0, 1.1]})
    assert main(["report", str(tmp_path), "--fail-on", "any"]) == 0
    out = capsys.readouterr().out
    assert "No layerwatch data in" not in out
    assert "== plain: no layerwatch data (other writers' tags only: loss)" in out
    assert "== watched: steps 0..1, 2 sampled\nAlerts: none" in out


def test_any_layerwatch_tag_counts_as_data(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("train/loss", 1.0, 0)
    writer.add_text("layerwatch/structure", "a table", 0)  # a tensor, as the plugin's data will be
    writer.close()
    assert main(["report", str(tmp_path), "--fail-on", "any"]) == 0
    assert "no layerwatch data" not in capsys.readouterr().out.lower()


def test_a_lightning_run_without_the_callback_fails_the_gate(tmp_path):
    from models import LitMLP
    from models import make_trainer

    make_trainer(tmp_path, [], max_steps=3).fit(LitMLP())
    done = subprocess.run([sys.executable, "-m", "layerwatch", "report", str(tmp_path), "--fail-on", "nonfinite"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "No layerwatch data in" in done.stdout and "cannot judge --fail-on nonfinite" in done.stderr


@pytest.mark.parametrize("value, text", [(11.6912, "11.69"), (1.9e5, "1.9e5"), (3.2e-6, "3.2e-6"), (0.08772, "0.08772")])
def test_norms_keep_four_digits_and_short_exponents(value, text):
    from layerwatch.reading.report import _number

    assert _number(value) == text


def test_an_event_file_that_cannot_be_read_is_a_usage_error(tmp_path, capsys):
    write_run(tmp_path, {"weights_norm/w": [1.0]})
    gone = tmp_path / "events.out.tfevents.1.gone"
    gone.symlink_to(tmp_path / "nowhere")  # listed, then cannot be opened
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == f"layerwatch report: error: cannot read {str(gone)!r}: No such file or directory"


def test_a_compiled_models_slowest_layers_are_said_to_be_its_eager_re_runs(tmp_path, capsys):
    """A compiled model's per-module values come from an eager, forward-only re-run: the report's
    slowest layers say so."""
    import torch
    import torch._dynamo

    from layerwatch import Inspector
    from models import MLP

    torch._dynamo.reset()
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="sampled 2 time"), Inspector(compiled, log_dir=tmp_path, every_n_steps=2,
                                                                         optimizer=opt) as inspector:
        for _ in range(4):
            compiled(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            inspector.step()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Slowest leaf layers (median fwd of the eager re-run: the model is compiled):\n" in out


def test_a_run_with_routers_lists_the_most_imbalanced_and_the_dead_experts(tmp_path, capsys):
    from moe_runs import load, write_loads

    a, b = "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"
    write_loads(tmp_path / "moe", {
        0: {a: load([4, 4, 4, 4]), b: load([8, 0, 4, 4])},
        2: {a: load([10, 6, 0, 0]), b: load([4, 4, 4, 4])},
        4: {a: load([12, 4, 0, 0]), b: load([6, 2, 4, 4])},
        6: {a: load([8, 8, 0, 0]), b: load([4, 4, 8, 0])},
    })
    write_run(tmp_path / "dense", {"grads_norm/fc.weight": [1.0, 2.0]})
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    dense, moe = out.split("== dense")[1].split("== moe")
    assert "Mixture-of-Experts" not in dense  # only a run with routers has the section
    section = moe.split("Mixture-of-Experts routers (2 routers, 8 experts):\n")[1].splitlines()
    assert section[0].startswith("  Most imbalanced (max / mean tokens per expert, 1 = balanced;")
    assert [line.split() for line in section[1:3]] == [
        [a, "2", "(step", "6)", "largest", "3", "(step", "4)"],  # latest 16 / 8; the run's largest 12 / 4
        [b, "2", "(step", "6)", "largest", "2", "(step", "0)"]]
    assert section[3] == "  Dead experts (no token at the latest sample) (3):"
    assert [line.split() for line in section[4:7]] == [
        [f"{a}#2", "since", "step", "2", "(3", "samples)"], [f"{a}#3", "since", "step", "2", "(3", "samples)"],
        [f"{b}#3", "since", "step", "6", "(1", "sample)"]]  # b#1 came back: not dead now
    assert main(["report", str(tmp_path), "--json"]) == 0
    runs = {run["run"]: run for run in json.loads(capsys.readouterr().out)["runs"]}
    assert runs["dense"]["experts"] is None
    experts = runs["moe"]["experts"]
    assert experts["routers"] == 2 and experts["experts"] == 8
    assert experts["most_imbalanced"][0] == {"router": a, "step": 6, "imbalance": 2.0, "max": 3.0, "max_step": 4}
    assert experts["dead"][2] == {"router": b, "expert": 3, "since": 6, "samples": 1, "last_step": 6}


def test_the_dead_experts_listed_stop_at_ten(tmp_path, capsys):
    from moe_runs import load, write_loads

    write_loads(tmp_path, {0: {"gate": load([24] + [0] * 15)}})
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  Dead experts (no token at the latest sample) (15):" in lines
    assert lines[-1] == "    … and 5 more" and lines[-2].split()[0] == "gate#10"
