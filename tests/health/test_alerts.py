import json
import logging
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from layerwatch import AlertRules, Inspector, InspectCallback
from layerwatch import stats as S
from layerwatch.health.alert import Alert, alerts_markdown, parse_alerts_markdown
from layerwatch.health.check import HealthMonitor
from layerwatch.cli import main
from models import MLP, FourBranches, train, train_branches


def alerts_text(acc):
    return acc.Tensors("layerwatch/alerts/text_summary")[-1].tensor_proto.string_val[0].decode()


@pytest.fixture
def sick_run(tmp_path):
    torch.manual_seed(0)
    model = FourBranches()
    with pytest.warns(RuntimeWarning, match="new alert"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            train_branches(model, 15, inspector)
    return tmp_path, inspector


def test_sick_layers_are_named_with_their_kind_and_the_healthy_one_is_not(sick_run, events):
    log_dir, inspector = sick_run
    found = {(a.kind, a.name) for a in inspector.alerts}
    assert found == {("dead", "dead"), ("stuck", "no_lr"), ("exploding", "growing")}
    table = parse_alerts_markdown(alerts_text(events(log_dir)))
    assert {(a.kind, a.name) for a in table} == found
    assert "healthy" not in alerts_text(events(log_dir))
    by_kind = {a.kind: a for a in inspector.alerts}
    assert by_kind["dead"].step == 2  # three samples in a row: steps 0, 1, 2
    assert "ReLU that never fires" in by_kind["dead"].message
    assert "learning rate above 0" in by_kind["stuck"].message
    assert "weights of layer growing grew" in by_kind["exploding"].message and "AlertRules.weight_factor is 10" in by_kind["exploding"].message


def test_alert_count_scalar_and_table_steps(sick_run, events):
    acc = events(sick_run[0])
    counts = {e.step: e.value for e in acc.Scalars("layerwatch/alerts")}
    assert counts[0] == 0 and counts[2] == 1 and counts[14] == 3
    assert all(counts[k] <= counts[k + 1] for k in range(14))
    table_steps = [t.step for t in acc.Tensors("layerwatch/alerts/text_summary")]
    assert table_steps == sorted({a.step for a in sick_run[1].alerts})  # written only when it changes


def test_report_json_names_the_same_alerts(sick_run, capsys):
    assert main(["report", str(sick_run[0]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {(a["kind"], a["name"]) for a in report["alerts"]} == {("dead", "dead"), ("stuck", "no_lr"), ("exploding", "growing")}
    assert all(set(a) == {"kind", "name", "step", "message", "run"} for a in report["alerts"])
    (run,) = report["runs"]
    assert run["steps"] == {"first": 0, "last": 14, "samples": 15}
    assert run["weights"]["largest"][0]["name"] == "growing.weight"
    assert run["weights"]["fastest_changing"][0]["name"] == "growing.weight"
    assert run["first_nonfinite"] is None
    leaves = {"dead", "no_lr", "growing", "healthy"}  # the root holds them, so it is not ranked
    assert {row["name"] for row in run["slowest"]} == leaves
    assert {row["name"] for row in run["largest_memory"]} == leaves


def test_report_fail_on(sick_run, capsys):
    assert main(["report", str(sick_run[0]), "--fail-on", "nonfinite,vanishing"]) == 0
    assert main(["report", str(sick_run[0]), "--fail-on", "vanishing,dead"]) == 1
    assert "1 alert(s) of kind dead (--fail-on vanishing,dead)" in capsys.readouterr().err
    assert main(["report", str(sick_run[0]), "--fail-on", "any"]) == 1


def test_report_text(sick_run, capsys):
    assert main(["report", str(sick_run[0])]) == 0
    out = capsys.readouterr().out
    assert "(1 run)" in out and "steps 0..14, 15 sampled" in out and "Alerts (3):" in out
    assert "dead       dead: every gradient of layer dead" in out
    assert "First non-finite: none" in out and "Largest weight norms (last sample):" in out
    slowest = out.split("Slowest leaf layers (median fwd + bwd):\n")[1].split("\n")[:4]
    assert sorted(line.split()[0] for line in slowest) == ["dead", "growing", "healthy", "no_lr"]
    assert all(line.split()[2] == "ms" for line in slowest)


def test_each_alert_goes_to_logging_once_and_warnings_once_per_step(tmp_path, caplog):
    model = FourBranches()
    with caplog.at_level(logging.WARNING, logger="layerwatch"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            train_branches(model, 15, inspector)
    records = [r.getMessage() for r in caplog.records if r.name == "layerwatch"]
    assert len(records) == 3 and all(m.startswith("layerwatch alert at step") for m in records)
    alert_warnings = [str(w.message) for w in seen if "new alert" in str(w.message)]
    assert len(alert_warnings) == len({a.step for a in inspector.alerts})


def test_nonfinite_is_raised_once_per_layer_at_its_step(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(RuntimeWarning, match="nonfinite fc1: NaN/Inf values in gradients of fc1.weight"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
            for step in range(8):
                x = torch.randn(4, 8)
                if step == 3:
                    x[0, 0] = math.nan
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                inspector.step()
    assert [(a.kind, a.name, a.step) for a in inspector.alerts] == [("nonfinite", "fc1", 3), ("nonfinite", "fc2", 3)]


def test_healthy_training_raises_nothing(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            train(model, 300, inspector)
    assert inspector.alerts == []


def test_vanishing_weights_and_absolute_bounds(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # only the loop below moves the weights
    rules = AlertRules(window=3, grad_norm_bounds=(None, 1e6), weight_norm_bounds=(None, 50.0))
    with pytest.warns(RuntimeWarning, match="new alert"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, alerts=rules) as inspector:
            for _ in range(10):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                with torch.no_grad():
                    model.fc1.weight.mul_(0.2)  # 0.2**3 per window, the layer's weight and bias: vanishing
                    model.fc1.bias.mul_(0.2)
                    model.fc2.weight.mul_(1.5)  # 1.5**3 per window, under the factor; crosses the bound
                inspector.step()
                opt.zero_grad()
    found = {(a.kind, a.name): a.message for a in inspector.alerts}
    assert set(found) == {("vanishing", "fc1"), ("exploding", "fc2"), ("stuck", "fc2")}
    assert "fc2.bias has a gradient but has not changed" in found[("stuck", "fc2")]  # lr 0: rightly stuck
    assert "weights of layer fc1 shrank 125x over the last 3 samples" in found[("vanishing", "fc1")]
    assert "above the bound 50" in found[("exploding", "fc2")]


def test_gradients_zeroed_before_step_are_not_judged(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(RuntimeWarning, match="every gradient is zero at sampled step 0; call inspector.step"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            for _ in range(6):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=False)  # too early: the inspector sees zeros
                inspector.step()
    assert inspector.alerts == []


def test_alerts_off(tmp_path, events):
    model = FourBranches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, alerts=False) as inspector:
            train_branches(model, 12, inspector)
    assert inspector.alerts == [] and "layerwatch/alerts" not in events(tmp_path).Tags()["scalars"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=0), "AlertRules.window must be an int >= 1, got 0"),
        (dict(dead_samples=2.5), "AlertRules.dead_samples must be an int >= 1, got 2.5"),
        (dict(weight_factor=1), "AlertRules.weight_factor must be a number > 1, got 1"),
        (dict(grad_factor="big"), "AlertRules.grad_factor must be a number > 1, got 'big'"),
        (dict(grad_norm_bounds=(1.0,)), r"AlertRules.grad_norm_bounds must be a \(low, high\) pair"),
        (dict(weight_norm_bounds=(5.0, 1.0)), "low must be below high, got \\(5.0, 1.0\\)"),
        (dict(weight_norm_bounds=(-1.0, None)), "numbers >= 0 or None, got \\(-1.0, None\\)"),
    ],
)
def test_bad_rules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlertRules(**kwargs)


def test_bad_alerts_option_is_refused(tmp_path):
    with pytest.raises(TypeError, match="alerts must be True, False or an AlertRules, got 'yes'"):
        Inspector(MLP(), log_dir=tmp_path, alerts="yes")
    with pytest.raises(TypeError, match="alerts must be True, False or an AlertRules, got 3"):
        InspectCallback(alerts=3)


def test_markdown_round_trip_keeps_pipes():
    alerts = [Alert("stuck", "a.b", 7, "x | y \\| z"), Alert("dead", "", 0, "plain")]
    assert parse_alerts_markdown(alerts_markdown(alerts)) == alerts


def test_monitor_needs_whole_windows_before_judging_norms():
    monitor = HealthMonitor(AlertRules(window=2))
    row = np.zeros(S.HIST)
    row[[S.COUNT, S.MIN, S.MAX]] = 4, -1, 1
    for step, norm in enumerate([1.0, 1.0, 1000.0]):  # a jump, but only three samples: no two whole windows
        row[S.SUMSQ] = norm**2
        assert monitor.observe(step, weights={"w": row.copy()}, grads=None, trainable=[]) == []
    (alert,) = monitor.observe(3, weights={"w": row.copy()}, grads=None, trainable=[])  # medians 1 and 1000
    assert (alert.kind, alert.name, alert.step) == ("exploding", "w", 3)
    assert monitor.observe(4, weights={"w": row.copy()}, grads=None, trainable=[]) == []  # raised once


# ---------------------------------------------------------------------- report edge cases


def write_run(path, tags, steps=3):
    writer = SummaryWriter(str(path))
    for step in range(steps):
        for tag, value in tags.items():
            writer.add_scalar(tag, value * (step + 1), step)
    writer.close()


def test_report_several_runs_and_probe_families(tmp_path, capsys):
    write_run(tmp_path / "a", {"weights_norm/w": 1.0, "fwd_ms/enc": 2.0, "bwd_ms/enc": 3.0, "fwd_ms/head": 1.0})
    write_run(tmp_path / "b" / "v0", {"grads_norm/w": 1.0, "activation_bytes/enc": 100.0, "grads_nonfinite/w": 0.0})
    assert main(["report", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = {run["run"]: run for run in report["runs"]}
    assert set(runs) == {"a", "b/v0"}
    assert runs["a"]["slowest"] == [{"name": "enc", "ms": 2 * 2.0 + 2 * 3.0}, {"name": "head", "ms": 2.0}]
    assert runs["b/v0"]["largest_memory"] == [{"name": "enc", "bytes": 200.0}]
    assert runs["b/v0"]["grads"]["fastest_changing"][0]["factor"] == pytest.approx(3.0)


def test_report_first_nonfinite(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path))
    for step, (w, g) in enumerate([(0, 0), (0, 0), (0, 5), (3, 5)]):
        writer.add_scalar("weights_nonfinite/fc.weight", w, step * 10)
        writer.add_scalar("grads_nonfinite/fc.weight", g, step * 10)
        writer.add_scalar("weights_norm/fc.weight", 1.0 + step, step * 10)
    writer.close()
    assert main(["report", str(tmp_path), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["first_nonfinite"] == {"step": 20, "tensors": ["grads_nonfinite/fc.weight"]}
    assert run["norms_until_step"] == 20 and run["weights"]["largest"][0]["step"] == 10


@pytest.mark.parametrize("make, message", [(lambda p: p / "missing", "does not exist"),
                                           (lambda p: p, "no TensorBoard event files under")])
def test_report_missing_or_empty_directory(tmp_path, make, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["report", str(make(tmp_path))])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_report_refuses_unknown_kinds(tmp_path, capsys):
    write_run(tmp_path, {"weights_norm/w": 1.0})
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path), "--fail-on", "dead,sad"])
    assert "--fail-on: unknown kind 'sad'; choose from dead, stuck" in capsys.readouterr().err


def test_report_reads_a_run_still_being_written_and_warns_on_damage(tmp_path, capsys):
    write_run(tmp_path, {"weights_norm/w": 1.0}, steps=4)
    (event_file,) = tmp_path.glob("*tfevents*")
    data = event_file.read_bytes()
    event_file.write_bytes(data + data[:20])  # a whole length header, part of the record: mid-write
    assert main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["steps"]["samples"] == 4
    event_file.write_bytes(data[:-30] + b"\xff" * 26 + data[-4:])  # the last record's data is garbage
    with pytest.warns(UserWarning, match="has a damaged record at byte"):
        assert main(["report", str(tmp_path), "--json"]) == 0
    event_file.write_bytes(data[:8] + b"\0\0\0\0" + data[12:])  # the first length checksum is wrong
    with pytest.warns(UserWarning, match="is damaged after 0 bytes"):
        assert main(["report", str(tmp_path), "--json"]) == 0


def test_python_dash_m_report(sick_run):
    done = subprocess.run([sys.executable, "-m", "layerwatch", "report", str(sick_run[0]), "--fail-on", "stuck"],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "stuck      no_lr" in done.stdout


# ---------------------------------------------------------------------- Lightning


def test_callback_exposes_alerts_after_fit(tmp_path):
    from models import LitMLP
    from models import make_trainer

    callback = InspectCallback(every_n_steps=1)
    with pytest.warns(RuntimeWarning, match="stuck"):
        make_trainer(tmp_path, [callback], max_steps=8).fit(LitMLP(lr=0.0))
    assert {(a.kind, a.name) for a in callback.alerts} == {("stuck", "net.0"), ("stuck", "net.2")}


def grad_row(norm: float) -> np.ndarray:
    row = np.zeros(S.HIST)
    row[[S.COUNT, S.MIN, S.MAX, S.SUMSQ]] = 4, -norm, norm, norm**2
    return row


def feed(monitor, norms_per_step: list[dict[str, float]]) -> list[Alert]:
    found = []
    for step, norms in enumerate(norms_per_step):
        grads = {name: grad_row(n) for name, n in norms.items()}
        found += monitor.observe(step, weights={}, grads=grads, trainable=list(grads))
    return found


def test_gradients_that_shrink_together_as_the_loss_nears_zero_are_healthy():
    steps = [{"a.weight": 10.0 ** -k, "b.weight": 3 * 10.0 ** -k} for k in range(12)]  # 1e11x down, together
    assert feed(HealthMonitor(AlertRules()), steps) == []
    alone = [{"a.weight": 1.0, "b.weight": 10.0 ** -k} for k in range(12)]  # one layer leaves the other behind
    (alert,) = feed(HealthMonitor(AlertRules()), alone)
    assert (alert.kind, alert.name) == ("vanishing", "b")
    assert "of the largest layer's" in alert.message and "no longer reaches it" in alert.message


def test_a_structurally_zero_gradient_beside_a_live_one_raises_nothing():
    """An attention key bias: its gradient is zero up to rounding (softmax ignores what it adds to
    a row's logits), jumping between 1e-16 and 1e-11, beside its weight's steady gradient."""
    rounding = np.random.default_rng(0).choice([1e-16, 1e-14, 1e-11], size=30)
    steps = [{"key.weight": 1e-2, "key.bias": float(noise), "value.weight": 1.0} for noise in rounding]
    assert feed(HealthMonitor(AlertRules()), steps) == []
    small_from_the_start = [{"query.weight": 1e-6, "value.weight": 1.0}] * 30  # 1e6x below, but always was
    assert feed(HealthMonitor(AlertRules()), small_from_the_start) == []


def test_gradients_coming_back_from_near_zero_are_not_exploding():
    levels = [1.0] * 5 + [1e-9] * 5 + [1e-2] * 5  # back up by 1e7x, still below the early level
    assert feed(HealthMonitor(AlertRules()), [{"a.weight": n} for n in levels]) == []
    blow_up = [1.0] * 5 + [1e5] * 5  # 1e5x, and never seen before
    (alert,) = feed(HealthMonitor(AlertRules()), [{"a.weight": n} for n in blow_up])
    assert (alert.kind, alert.step) == ("exploding", 9)


def test_weights_that_moved_and_then_stopped_are_not_stuck(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 if k < 4 else 0.0)  # ends at lr 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
            for _ in range(12):
                model(torch.randn(8, 8)).pow(2).mean().backward()
                opt.step()
                schedule.step()
                opt.zero_grad()
                inspector.step()
    assert inspector.alerts == []


class LoRALinear(nn.Module):
    """A frozen base with a zero bias (as in GPT-2's frozen LoRA runs) and a trainable
    low-rank adapter whose B starts at zero."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        nn.init.zeros_(self.base.bias)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(8, 2, bias=False)
        self.lora_B = nn.Linear(2, 8, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.base(x) + self.lora_B(self.lora_A(x))))


def test_frozen_zero_weights_are_not_dead(tmp_path):
    torch.manual_seed(0)
    model = LoRALinear()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
            train(model, 12, inspector, optimizer=opt)
    assert inspector.alerts == []
    monitor = HealthMonitor(AlertRules(dead_samples=2))
    zero = np.zeros(S.HIST)
    zero[S.COUNT] = 8
    for step in range(3):  # the same all-zero weights: dead when trainable, nothing when frozen
        alerts = monitor.observe(step, weights={"a.bias": zero, "b.bias": zero}, grads=None, trainable=["a.bias"])
        assert [a.name for a in alerts] == (["a"] if step == 1 else [])


@pytest.mark.parametrize("steps, said", [(6, True), (10, False)])
def test_a_run_too_short_for_the_window_rules_says_so_once(tmp_path, steps, said):
    model = MLP()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            train(model, steps, inspector)
        inspector.finish()  # a second finish says nothing more
    notes = [str(w.message) for w in seen if "could not fire" in str(w.message)]
    assert len(notes) == int(said)
    if said:
        assert f"sampled {steps} time(s)" in notes[0] and "need 10 samples" in notes[0]
