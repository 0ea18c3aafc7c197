"""Where the records go (:class:`layerwatch.engine.output.Output`), tested on its own: the TensorBoard
sink it opens or wraps, the sinks added, and the alerts it says."""

from __future__ import annotations

import logging
import warnings

import pytest
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from layerwatch.sinks import record as R
from layerwatch.health.alert import Alert
from layerwatch.distributed.sharding import Layout
from layerwatch.guards.failures import FailurePolicy
from layerwatch.guards.hooks import Attachments
from layerwatch.options import validate_options
from layerwatch.engine.output import Output
from layerwatch.engine.placement import Placement
from layerwatch.vocabulary import OVERHEAD_MS, SAMPLE_INTERVAL

LAYOUT_TAG = "custom_scalars__config__"  # where TensorBoard keeps the Custom Scalars layout


class FakeWriter:
    """A writer with the SummaryWriter interface that records its calls; ``fail`` makes
    add_scalar raise, as a full disk would."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[str] = []
        self.scalars: list[tuple[str, float, int]] = []
        self.layouts: list[dict] = []

    def add_scalar(self, tag, value, step):
        self.calls.append("add_scalar")
        if self.fail:
            raise OSError("No space left on device")
        self.scalars.append((tag, value, step))

    def add_histogram_raw(self, *args):
        self.calls.append("add_histogram_raw")

    def add_custom_scalars(self, layout):
        self.calls.append("add_custom_scalars")
        self.layouts.append(layout)

    def flush(self):
        self.calls.append("flush")


def output(writer=None):
    return Output(Attachments(), FailurePolicy(), writer)


def runtime_warnings(action):
    """``action()``'s RuntimeWarnings' messages, every one of them (none filtered as repeated)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def spy(obj, *methods):
    """Records the names of ``obj``'s ``methods`` as they are called (and still calls them)."""
    calls = []
    for name in methods:
        def recorded(*args, _name=name, _method=getattr(obj, name), **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)
        setattr(obj, name, recorded)
    return calls


def model():
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def write_layout(out, step=0):
    out.write_layout(model(), Placement(Layout()), validate_options(every_n_steps=1), step)


# ---------------------------------------------------------------------- the writer


class ScalarsOnly:
    """A writer that can add scalars but neither histograms nor flush."""

    def add_scalar(self, tag, value, step):
        pass


@pytest.mark.parametrize("writer", [object(), "runs/x", ScalarsOnly()])
def test_a_writer_without_the_summary_writer_methods_is_refused_naming_its_type(writer):
    with pytest.raises(TypeError, match=f"writer must be a SummaryWriter, got {type(writer).__name__}$"):
        output(writer)


def test_a_writer_of_another_library_with_the_methods_is_accepted():
    out = output(FakeWriter())
    out.open(None)
    assert out.sink is not None and out.sink.owns_writer is False


def test_open_without_a_writer_makes_an_event_file_in_log_dir_that_close_flushes_and_closes(tmp_path, events):
    out = output()
    out.open(tmp_path)
    sink = out.sink
    assert sink is not None and sink.owns_writer
    out.emit(R.build(3, overhead_ms=12.5), 3)
    write_layout(out)
    out.close(3)
    assert out.sink is None
    assert sink.writer.all_writers is None  # our own writer is closed
    files = list(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = events(tmp_path)
    assert [(s.step, s.value) for s in acc.Scalars(OVERHEAD_MS)] == [(3, 12.5)]
    assert LAYOUT_TAG in acc.Tags()["tensors"]


def test_a_callers_writer_is_flushed_at_close_but_not_closed(tmp_path, events):
    writer = SummaryWriter(log_dir=str(tmp_path))
    file_writer = writer._get_file_writer()
    out = output(writer)
    out.open(tmp_path / "ignored")
    assert out.sink.writer is writer and not out.sink.owns_writer
    out.emit(R.build(1, overhead_ms=2.0), 1)
    write_layout(out)
    calls = spy(writer, "flush", "close")
    out.close(1)
    assert calls == ["flush"]
    assert out.sink is None
    acc = events(tmp_path)  # read before the caller closes the writer
    assert [s.step for s in acc.Scalars(OVERHEAD_MS)] == [1]
    assert LAYOUT_TAG in acc.Tags()["tensors"]
    writer.add_scalar("mine", 4.0, 2)  # the writer still works, into the same file
    assert writer._get_file_writer() is file_writer
    writer.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert not (tmp_path / "ignored").exists()
    assert [(s.step, s.value) for s in events(tmp_path).Scalars("mine")] == [(2, 4.0)]


def test_a_writer_that_cannot_be_opened_is_warned_once_and_nothing_is_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = output()
    added = []
    out.add(added.append)
    messages = runtime_warnings(lambda: out.open(blocker / "logs"))
    assert len(messages) == 1 and messages[0].startswith("layerwatch: could not open the TensorBoard writer")
    assert out.sink is None
    out.emit(R.build(0, overhead_ms=1.0), 0)
    assert [r.step for r in added] == [0]  # the added sinks go on


# ---------------------------------------------------------------------- the sinks


def test_emit_hands_the_record_to_the_tensorboard_sink_and_every_added_sink():
    writer = FakeWriter()
    out = output(writer)
    out.open(None)
    first, second = [], []
    out.add(first.append)
    out.add(second.append)
    rec = R.build(5, overhead_ms=3.0, sample_interval=10)
    out.emit(rec, 5)
    assert first == [rec] and second == [rec]
    assert sorted(writer.scalars) == sorted([(OVERHEAD_MS, 3.0, 5), (SAMPLE_INTERVAL, 10, 5)])


def test_emit_without_a_tensorboard_sink_still_reaches_the_added_sinks():
    out = output()
    added = []
    out.add(added.append)
    rec = R.build(0)
    out.emit(rec, 0)
    assert added == [rec]


def test_a_failing_added_sink_is_warned_once_and_the_others_still_get_the_record():
    out = output()
    before, after = [], []

    def broken(rec):
        raise KeyError("no such run")

    out.add(before.append)
    out.add(broken)
    out.add(after.append)
    messages = runtime_warnings(lambda: [out.emit(R.build(step), step) for step in (3, 4, 5)])
    assert len(messages) == 1
    assert messages[0].startswith("layerwatch: could not hand the step to an added sink at step 3: KeyError")
    assert [r.step for r in before] == [3, 4, 5]
    assert [r.step for r in after] == [3, 4, 5]


def test_a_failed_write_drops_the_tensorboard_sink_after_one_warning():
    writer = FakeWriter(fail=True)
    out = output(writer)
    out.open(None)
    added = []
    out.add(added.append)
    first = runtime_warnings(lambda: out.emit(R.build(2, overhead_ms=1.0), 2))
    assert len(first) == 1
    assert first[0].startswith("layerwatch: could not write the sampled step at step 2: OSError")
    assert out.sink is None
    calls = list(writer.calls)
    later = runtime_warnings(lambda: (out.emit(R.build(3, overhead_ms=1.0), 3), write_layout(out, 3), out.close(3)))
    assert later == []
    assert writer.calls == calls  # nothing more reaches the writer, not even a flush at close
    assert [r.step for r in added] == [2, 3]


def test_write_layout_writes_the_charts_of_the_models_layers():
    writer = FakeWriter()
    out = output(writer)
    out.open(None)
    write_layout(out)
    [layout] = writer.layouts
    assert "layerwatch: grads_norm" in layout
    assert all(name.startswith("layerwatch: ") for name in layout)


def test_write_layout_writes_nothing_when_there_is_no_sink(tmp_path):
    out = output()
    write_layout(out)  # never opened
    assert out.sink is None
    writer = FakeWriter()
    out = output(writer)
    out.open(None)
    out.close(0)
    writer.calls.clear()
    write_layout(out)  # closed
    assert writer.calls == [] and writer.layouts == []


# ---------------------------------------------------------------------- the alerts


ALERTS = [
    Alert("exploding_grads", "fc1.weight", 7, "gradient norm grew 1000x"),
    Alert("dead_units", "fc2", 7, "90% of units never fire"),
]


def test_announce_logs_one_record_per_alert_and_warns_once_listing_them(caplog):
    caplog.set_level(logging.WARNING, logger="layerwatch")
    out = output()
    messages = runtime_warnings(lambda: out.announce(7, ALERTS))
    assert [r.getMessage() for r in caplog.records if r.name == "layerwatch"] == [
        "layerwatch alert at step 7: exploding_grads fc1.weight: gradient norm grew 1000x",
        "layerwatch alert at step 7: dead_units fc2: 90% of units never fire",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert messages == [
        "layerwatch: 2 new alert(s) at step 7:\n"
        "  exploding_grads fc1.weight: gradient norm grew 1000x\n"
        "  dead_units fc2: 90% of units never fire"
    ]


def test_announce_warns_again_at_each_step_with_new_alerts():
    out = output()
    messages = runtime_warnings(lambda: (out.announce(7, ALERTS[:1]), out.announce(9, ALERTS[1:])))
    assert [m.splitlines()[0] for m in messages] == [
        "layerwatch: 1 new alert(s) at step 7:", "layerwatch: 1 new alert(s) at step 9:"]


def test_announce_without_alerts_says_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="layerwatch")
    assert runtime_warnings(lambda: output().announce(4, [])) == []
    assert caplog.records == []


def test_write_step_builds_the_record_hands_it_on_and_announces_its_alerts(caplog):
    caplog.set_level(logging.WARNING, logger="layerwatch")
    out = output()
    added = []
    out.add(added.append)
    findings = R.Findings(alerts=ALERTS, alert_count=2)
    seconds = []
    messages = runtime_warnings(lambda: seconds.append(out.write_step(
        7, {}, None, None, findings, validate_options(every_n_steps=1), cost_s=0.25, interval=20, all_grads=True)))
    [rec] = added
    assert rec.step == 7 and rec.alerts == ALERTS
    assert rec.scalars[OVERHEAD_MS] == pytest.approx(250.0)
    assert rec.scalars[SAMPLE_INTERVAL] == 20
    assert seconds[0] >= 0
    assert len(messages) == 1 and messages[0].startswith("layerwatch: 2 new alert(s) at step 7:")
    assert len([r for r in caplog.records if r.name == "layerwatch"]) == 2
