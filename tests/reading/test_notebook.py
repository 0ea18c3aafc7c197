"""layerwatch.load, load_histograms, load_alerts and `layerwatch export`: a run in a notebook."""

import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

import layerwatch  # noqa: E402
from layerwatch import InspectCallback, Inspector  # noqa: E402
from layerwatch.cli import main  # noqa: E402
from layerwatch.reading.notebook import ALERT_COLUMNS, HISTOGRAM_COLUMNS, SCALAR_COLUMNS  # noqa: E402
from layerwatch.reading.events import Reader  # noqa: E402
from models import MLP, LitMLP, make_trainer, train  # noqa: E402

INJECTED = 25


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A demo run with a NaN injected at step 25 (replayed): its log directory."""
    log_dir = tmp_path_factory.mktemp("demo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["demo", "--steps", "40", "--every", "10", "--logdir", str(log_dir), "--inject-nan", str(INJECTED)]) == 0
    return log_dir


def inspected_run(log_dir, steps=6, every=2):
    model = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=log_dir, every_n_steps=every) as inspector:
            train(model, steps, inspector)


def test_load_gives_every_gradient_norm_tensorboard_shows_and_nan_from_the_injected_step(demo, events):
    frame = layerwatch.load(demo)
    assert list(frame.columns) == SCALAR_COLUMNS and set(frame.run) == {"demo/version_0"}
    acc = events(demo / "demo" / "version_0")
    cards = [tag for tag in acc.Tags()["scalars"] if tag.startswith("grads_norm/")]
    assert len(cards) == 8  # every parameter of the demo's model
    grads = frame[frame.series == "grads_norm"]
    for tag in cards:
        mine = grads[grads.layer == tag.partition("/")[2]].set_index("step").value
        theirs = {e.step: e.value for e in acc.Scalars(tag)}
        assert sorted(mine.index) == sorted(theirs) == [0, 10, 20, 25, 30]
        for step, value in theirs.items():
            assert (math.isnan(value) and math.isnan(mine[step])) or mine[step] == value, (tag, step)
            assert math.isnan(mine[step]) == (step >= INJECTED), (tag, step)  # NaN stays NaN, from the fault on
    run_wide = frame[frame.layer == ""]
    assert {"grad_norm", "overhead_ms", "first_nonfinite_step"} <= set(run_wide.series)
    assert run_wide[run_wide.series == "first_nonfinite_step"].value.tolist() == [INJECTED]


def test_load_has_the_tabs_series_that_are_not_cards_for_every_module(demo, events):
    from layerwatch.demo import DemoModule
    from layerwatch.probes import probe_name

    frame = layerwatch.load(demo)
    acc = events(demo / "demo" / "version_0")
    assert not [tag for tag in acc.Tags()["scalars"] if tag.startswith("activation_bytes/")]  # not a card
    modules = {probe_name(name) for name, _ in DemoModule().named_modules()}
    measured = frame[frame.series == "activation_bytes"]
    assert set(measured.layer) == modules
    assert (measured.groupby("layer").step.nunique() == 5).all()  # every sampled step
    reader = Reader()  # the tab's data as TensorBoard's own loader reads it
    for tag in acc.Tags()["tensors"]:
        if tag.startswith(("layerwatch/series/", "layerwatch/layout")):
            for event in acc.Tensors(tag):
                reader.add_tensor(event.step, event.wall_time, tag, event.tensor_proto)
    for step, (names, values) in reader.series("activation_bytes").items():
        mine = measured[measured.step == step].set_index("layer").value
        assert {n: v for n, v in zip(names, values.tolist()) if v != -math.inf} == mine.to_dict()
    assert not frame.duplicated(["run", "step", "series", "layer"]).any()  # every value once


def test_load_alerts_has_the_first_offender_at_the_injected_step(demo):
    alerts = layerwatch.load_alerts(demo)
    assert list(alerts.columns) == ALERT_COLUMNS
    offender = alerts[alerts.kind == "first_offender"]
    assert offender[["step", "layer"]].values.tolist() == [[INJECTED, "encoder.fault"]]
    assert "replayed from step 25" in offender.message.iloc[0]
    assert alerts[alerts.kind == "first_nonfinite_step"].step.tolist() == [INJECTED]
    assert set(alerts[alerts.kind == "nonfinite"].layer) >= {"encoder.fault"}


def test_each_histograms_counts_sum_to_its_num(demo, events):
    hist = layerwatch.load_histograms(demo)
    assert list(hist.columns) == HISTOGRAM_COLUMNS
    totals = hist.groupby(["step", "tensor"]).agg(count=("count", "sum"), num=("num", "first"), buckets=("bucket", "size"))
    assert np.allclose(totals["count"], totals["num"]) and totals.buckets.between(1, 34).all()
    acc = events(demo / "demo" / "version_0")
    assert len(totals) == sum(len(acc.Histograms(tag)) for tag in acc.Tags()["histograms"])
    one = hist[(hist.tensor == "grads/head.weight") & (hist.step == 0)]
    assert one.left.iloc[0] == one["min"].iloc[0] and (one.left.values[1:] == one.right.values[:-1]).all()


def test_a_run_resumed_into_its_version_directory_reads_as_one_run_without_repeated_steps(tmp_path):
    first = make_trainer(tmp_path, [InspectCallback(every_n_steps=2)], max_steps=3)
    first.fit(LitMLP())
    ckpt = tmp_path / "at3.ckpt"
    first.save_checkpoint(ckpt)
    for _ in range(2):  # resumed twice from the same checkpoint: step 4 is written again
        make_trainer(tmp_path, [InspectCallback(every_n_steps=2)], max_steps=6).fit(LitMLP(), ckpt_path=ckpt)
    assert len(list((tmp_path / "tb" / "version_0").glob("*tfevents*"))) == 3
    frame = layerwatch.load(tmp_path)
    assert set(frame.run) == {"tb/version_0"}
    assert not frame.duplicated(["run", "step", "series", "layer"]).any()
    assert sorted(frame[frame.series == "grads_norm"].step.unique()) == [0, 2, 4]


def test_each_run_of_a_directory_is_its_own_and_runs_choose_them(tmp_path):
    inspected_run(tmp_path / "lr-a")
    inspected_run(tmp_path / "lr-b", every=3)
    assert set(layerwatch.load(tmp_path).run) == {"lr-a", "lr-b"}
    assert set(layerwatch.load(tmp_path, runs="lr-b").run) == {"lr-b"}
    assert set(layerwatch.load(tmp_path, runs=["lr-a"]).run) == {"lr-a"}
    assert set(layerwatch.load(tmp_path, runs="lr-*").run) == {"lr-a", "lr-b"}
    steps = layerwatch.load(tmp_path, runs="lr-b").step.unique()
    assert sorted(steps) == [0, 3]
    with pytest.raises(ValueError, match=r"no run .* matches runs='nope'; runs found: lr-a, lr-b"):
        layerwatch.load(tmp_path, runs="nope")


def test_a_file_cut_mid_record_loads_what_comes_before_with_one_warning(tmp_path):
    inspected_run(tmp_path, steps=8)
    (path,) = tmp_path.glob("*tfevents*")
    whole = layerwatch.load(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # the last record cut short
    with pytest.warns(RuntimeWarning, match="cut short") as seen:
        cut = layerwatch.load(tmp_path)
    assert len([w for w in seen if "cut short" in str(w.message)]) == 1
    assert 0 < len(cut) < len(whole) and sorted(cut.step.unique())[:3] == [0, 2, 4]


def test_bad_log_directories_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        layerwatch.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="no TensorBoard event files"):
        layerwatch.load(tmp_path)
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "other")) as writer:
        writer.add_scalar("loss", 1.0, 0)
    with pytest.raises(ValueError, match="no layerwatch data under .*; runs found: other"):
        layerwatch.load_alerts(tmp_path)
    with pytest.raises(TypeError, match="runs must be"):
        layerwatch.load(tmp_path, runs=3)


def test_without_pandas_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r'pip install "layerwatch\[pandas\]"'):
        layerwatch.load(tmp_path)


def test_importing_layerwatch_imports_no_pandas():
    code = "import sys, layerwatch; layerwatch.load; assert 'pandas' not in sys.modules, 'pandas imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_export_writes_the_three_tables(demo, tmp_path, capsys):
    out = tmp_path / "tables"
    assert main(["export", str(demo), "--out", str(out)]) == 0
    scalars = pd.read_csv(out / "scalars.csv", keep_default_na=False, na_values=["NaN", "nan"])
    assert len(scalars) == len(layerwatch.load(demo)) and list(scalars.columns) == SCALAR_COLUMNS
    assert len(pd.read_csv(out / "histograms.csv")) == len(layerwatch.load_histograms(demo))
    assert "first_offender" in set(pd.read_csv(out / "alerts.csv").kind)
    assert "scalars.csv" in capsys.readouterr().out


def test_export_to_parquet_without_pyarrow_says_so_and_exits_2(demo, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    assert main(["export", str(demo), "--out", str(tmp_path / "t"), "--format", "parquet"]) == 2
    assert "needs pyarrow" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_export_names_a_missing_log_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "t")])
    assert exit_.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_torch_is_not_needed_to_read(tmp_path):
    inspected_run(tmp_path)
    code = ("import sys; sys.modules['torch'] = None; import layerwatch; "
            f"df = layerwatch.load({str(tmp_path)!r}); assert len(df) > 0")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)  # raises when the read fails


# ---------------------------------------------------------------------- load_histograms(tensors=, steps=)


@pytest.fixture(scope="module")
def filtered_run(tmp_path_factory):
    """An MLP (fc1 -> act -> fc2) sampled at steps 0, 2, 4 and 6, with a histogram of another
    writer's in the same event file, at every step: its log directory."""
    from torch.utils.tensorboard import SummaryWriter

    log_dir = tmp_path_factory.mktemp("run")
    model = MLP()
    with warnings.catch_warnings(), SummaryWriter(str(log_dir)) as writer:
        warnings.simplefilter("ignore")
        with Inspector(model, writer=writer, every_n_steps=2) as inspector:
            train(model, 7, inspector)
        for step in range(7):
            writer.add_histogram("custom/h", np.array([1.0, 2.0, float(step)]), step)
    return log_dir


def tensors_of(frame) -> set:
    return set(frame.tensor)


def subset(full, tensors, steps):
    """``full``'s rows of these tags and steps, numbered afresh."""
    return full[full.tensor.isin(tensors) & full.step.isin(steps)].reset_index(drop=True)


def test_tensors_choose_by_name_glob_or_whole_tag_and_read_what_reading_everything_reads(filtered_run):
    full = layerwatch.load_histograms(filtered_run)
    assert {"weights/fc1.weight", "grads/fc1.weight", "activations/fc1", "custom/h"} <= tensors_of(full)
    every = set(full.step)
    cases = {
        "fc1.weight": {"weights/fc1.weight", "grads/fc1.weight"},  # a name: the weight's and its gradient's
        "fc1": {"activations/fc1"},  # a module's output; a name is whole, not a prefix
        "fc*.bias": {"weights/fc1.bias", "grads/fc1.bias", "weights/fc2.bias", "grads/fc2.bias"},
        "grads/fc2.*": {"grads/fc2.weight", "grads/fc2.bias"},  # with a "/": the whole tag
        "custom/*": {"custom/h"},  # another writer's histogram, by its tag
    }
    for tensors, tags in cases.items():
        chosen = layerwatch.load_histograms(filtered_run, tensors=tensors)
        assert tensors_of(chosen) == tags, tensors
        pd.testing.assert_frame_equal(chosen, subset(full, tags, every))
    both = layerwatch.load_histograms(filtered_run, tensors=["fc1.weight", "grads/fc2.bias"])
    assert tensors_of(both) == {"weights/fc1.weight", "grads/fc1.weight", "grads/fc2.bias"}
    assert "custom/h" not in tensors_of(layerwatch.load_histograms(filtered_run, tensors="*"))  # names are layerwatch's


def test_steps_take_a_list_a_range_or_a_slice_and_combine_with_tensors(filtered_run):
    full = layerwatch.load_histograms(filtered_run)
    tags = set(full.tensor)
    assert sorted(set(full.step)) == list(range(7))  # layerwatch's samples at 0, 2, 4, 6; the other writer's at all
    for steps, expected in (([4, 0], {0, 4}), (np.array([6, 1]), {1, 6}), (range(2, 6), {2, 3, 4, 5}),
                            (range(6, 0, -3), {3, 6}), (slice(None, None, 3), {0, 3, 6}),
                            (slice(5, None), {5, 6}), (slice(None, 3), {0, 1, 2}), (slice(1, 7, 2), {1, 3, 5})):
        chosen = layerwatch.load_histograms(filtered_run, steps=steps)
        assert set(chosen.step) == expected, steps
        pd.testing.assert_frame_equal(chosen, subset(full, tags, expected))
    one = layerwatch.load_histograms(filtered_run, tensors="fc2.weight", steps=[2])
    pd.testing.assert_frame_equal(one, subset(full, {"weights/fc2.weight", "grads/fc2.weight"}, {2}))
    assert layerwatch.load_histograms(filtered_run, tensors="fc1", steps=[1, 3]).empty  # steps with no sample of it


def test_records_of_other_steps_and_values_of_other_tensors_are_not_parsed(filtered_run, monkeypatch):
    from layerwatch.reading import events

    parsed = []
    whole = events.event

    def counting(data):
        event = whole(data)
        parsed.append(event)
        return event

    def histograms_parsed() -> set:
        return {(e.step, v.tag.partition("/")[0]) for e in parsed for v in e.summary.value if v.HasField("histo")}

    monkeypatch.setattr(events, "event", counting)
    assert set(layerwatch.load_histograms(filtered_run, steps=[2, 3]).step) == {2, 3}
    # A record of another step is passed over by its head. Protobuf leaves a step of 0 out of an
    # event (layerwatch writes it), so the other writer's step 0 is parsed to learn its step.
    assert histograms_parsed() == {(2, "weights"), (2, "grads"), (2, "activations"), (2, "custom"), (3, "custom"),
                                   (0, "custom")}
    parsed.clear()
    assert len(layerwatch.load_histograms(filtered_run, tensors=["fc1.weight", "custom/h"])) > 0
    assert histograms_parsed() == {(0, "custom")}  # layerwatch's records: a byte scan, none parsed whole


def test_tensors_matching_no_histogram_name_some_that_exist(filtered_run):
    with pytest.raises(ValueError, match=r"no histogram under .* matches tensors='fc9\.weight'; its histograms are "
                                         r"activations/\(root\), activations/act, .* and \d+ more"):
        layerwatch.load_histograms(filtered_run, tensors="fc9.weight")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"tensors": 3}, TypeError, r"tensors must be a tensor's name or a glob, or a list of them; got 3$"),
    ({"tensors": b"fc1"}, TypeError, r"tensors must be a tensor's name or a glob, or a list of them; got b'fc1'"),
    ({"tensors": ["fc1.weight", 5]}, TypeError, r"tensors must hold tensor names or globs \(strings\); got 5 \(int\) "
                                                r"in \['fc1\.weight', 5\]"),
    ({"tensors": []}, ValueError, r"tensors=\[\] chooses no histogram; leave it out \(None\) for every one"),
    ({"tensors": ["fc1", ""]}, ValueError, r"tensors holds an empty name: \['fc1', ''\]"),
    ({"steps": 4}, TypeError, r"steps must be a list of step numbers, a range or a slice, got 4: for step 4 alone pass "
                              r"\[4\]; for the steps before it, range\(4\)"),
    ({"steps": "4"}, TypeError, r"steps must be a list of step numbers, a range or a slice, got '4'"),
    ({"steps": [0, 1.5]}, TypeError, r"steps must hold step numbers \(ints\); got 1\.5 \(float\)"),
    ({"steps": [True]}, TypeError, r"got True \(bool\)"),
    ({"steps": [2, -1]}, ValueError, r"steps=\[2, -1\] holds a negative step \(-1\); steps are numbered from 0, and a "
                                     r"negative one does not count from the end"),
    ({"steps": slice(-3, None)}, ValueError, r"steps=slice\(-3, None, None\) holds a negative step \(-3\)"),
    ({"steps": range(-2, 3)}, ValueError, r"holds a negative step \(-2\)"),
    ({"steps": slice(0, 10, 0)}, ValueError, r"steps=slice\(0, 10, 0\): the slice's step must be >= 1"),
    ({"steps": slice(0, 2.5)}, TypeError, r"steps=slice\(0, 2\.5, None\): a slice of step numbers takes ints or None, "
                                          r"got 2\.5"),
    ({"steps": range(5, 5)}, ValueError, r"steps=range\(5, 5\) chooses no step; leave it out \(None\) for every one"),
    ({"steps": []}, ValueError, r"steps=\[\] chooses no step"),
])
def test_bad_tensors_and_steps_are_named_before_anything_is_read(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        layerwatch.load_histograms(tmp_path / "missing", **kwargs)  # refused before the directory is looked at


def test_export_writes_the_chosen_histograms_and_every_scalar(filtered_run, tmp_path, capsys):
    out = tmp_path / "tables"
    assert main(["export", str(filtered_run), "--out", str(out), "--tensors", "fc1.weight,grads/fc2.*", "--steps", "1:5"]) == 0
    written = pd.read_csv(out / "histograms.csv")
    expected = layerwatch.load_histograms(filtered_run, tensors=["fc1.weight", "grads/fc2.*"], steps=slice(1, 5))
    assert set(written.tensor) == {"weights/fc1.weight", "grads/fc1.weight", "grads/fc2.weight", "grads/fc2.bias"}
    assert sorted(set(written.step)) == [2, 4] and len(written) == len(expected)
    assert len(pd.read_csv(out / "scalars.csv")) == len(layerwatch.load(filtered_run))  # the filters are the histograms' only
    capsys.readouterr()
    assert main(["export", str(filtered_run), "--out", str(tmp_path / "t2"), "--steps", "6,0"]) == 0
    assert set(pd.read_csv(tmp_path / "t2" / "histograms.csv").step) == {0, 6}


@pytest.mark.parametrize("argv, message", [
    (["--steps", "x"], "argument --steps: expected step numbers (N,N,...) or START:STOP[:STEP], got 'x'"),
    (["--steps", "1:2:3:4"], "argument --steps: expected step numbers (N,N,...) or START:STOP[:STEP], got '1:2:3:4'"),
    (["--steps=-1"], "steps=[-1] holds a negative step (-1); steps are numbered from 0, and a negative one does "
                     "not count from the end"),
    (["--steps", "0:10:0"], "steps=slice(0, 10, 0): the slice's step must be >= 1"),
    (["--tensors", ","], "tensors=[] chooses no histogram; leave it out (None) for every one"),
])
def test_export_names_bad_filters(filtered_run, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(filtered_run), "--out", str(tmp_path / "t")] + argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"layerwatch export: error: {message}"
