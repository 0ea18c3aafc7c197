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
from layerwatch.notebook import ALERT_COLUMNS, HISTOGRAM_COLUMNS, SCALAR_COLUMNS  # noqa: E402
from layerwatch.tensorboard_plugin.metadata import Reader  # noqa: E402
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
