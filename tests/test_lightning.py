import csv
import math
import re
from pathlib import Path

import pytest
import torch

from lightning.pytorch.loggers import CSVLogger

from layerwatch import InspectCallback
from layerwatch.engine.budget import Pacer
from models import LitMLP, TwoOptimizers, dataset, make_trainer, scripted_ideal


def test_layer_charts_share_the_run_with_the_modules_own_metrics(tmp_path, events):
    model = LitMLP()
    trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=2)])
    trainer.fit(model)
    run = Path(trainer.logger.log_dir)
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # one run, one writer
    acc = events(run)
    scalars = acc.Tags()["scalars"]
    assert "train_loss" in scalars
    assert "weights/net.0.weight" in acc.Tags()["histograms"] and "grads/net.2.bias" in acc.Tags()["histograms"]
    table = acc.Tensors("layerwatch/structure/text_summary")
    assert [t.step for t in table] == [0]
    assert re.search(r"0 \(Linear\) +\[8, 8\] +\[8, 16\]", table[0].tensor_proto.string_val[0].decode())  # real batch
    assert acc.Scalars("layerwatch/macs_per_step")[0].value == 8 * 8 * 16 + 8 * 16 * 1
    assert [e.step for e in acc.Scalars("weights_norm/net.0.weight")] == [0, 2, 4]
    assert "update_ratio/net.0.weight" in scalars  # the callback always sees the optimizer step
    # gradients are the ones the optimizer is about to use, read in on_before_optimizer_step
    for event in acc.Scalars("grads_norm/net.0.weight"):
        assert event.value == pytest.approx(model.seen_grad_norms[event.step]["net.0.weight"], rel=1e-5)


def test_gradients_are_read_before_clipping(tmp_path, events):
    model = LitMLP()
    trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=1)], gradient_clip_val=1e-4, max_steps=2)
    trainer.fit(model)
    acc = events(trainer.logger.log_dir)
    assert acc.Scalars("layerwatch/grad_norm")[0].value > 1e-2  # clipping would make it <= 1e-4


def test_gradient_accumulation_samples_the_optimizer_step(tmp_path, events):
    model = LitMLP()
    trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=2)], accumulate_grad_batches=3, max_steps=4)
    trainer.fit(model)
    acc = events(trainer.logger.log_dir)
    grads = acc.Scalars("grads_norm/net.2.weight")
    assert [e.step for e in grads] == [0, 2]
    for event in grads:  # the accumulated gradient of 3 micro-batches
        assert event.value == pytest.approx(model.seen_grad_norms[event.step]["net.2.weight"], rel=1e-5)


def test_manual_optimization_with_two_optimizers(tmp_path, events):
    trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=4)], max_steps=8)
    trainer.fit(TwoOptimizers())
    acc = events(trainer.logger.log_dir)
    assert [e.step for e in acc.Scalars("grads_norm/first.weight")] == [0, 4]
    assert [e.step for e in acc.Scalars("grads_norm/second.bias")] == [0, 4]


def test_without_tensorboard_logger_writes_its_own_run_and_feeds_other_loggers(tmp_path, events, capsys):
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    callback = InspectCallback(every_n_steps=2)
    trainer = make_trainer(tmp_path, [callback], logger=csv_logger)
    trainer.fit(LitMLP())
    own = Path(csv_logger.log_dir) / "layerwatch"
    assert callback.log_dir == str(own)
    assert "weights/net.0.weight" in events(own).Tags()["histograms"]
    with open(Path(csv_logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("layerwatch/grad_norm")]
    assert [int(r["step"]) for r in rows] == [0, 2, 4]
    assert [(int(r["step"]), float(r["layerwatch/params_total"])) for r in rows if r["layerwatch/params_total"]] == [
        (0, 8 * 16 + 16 + 16 + 1)
    ]


def test_logger_false_writes_under_default_root_dir(tmp_path, events):
    trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=3)], logger=False)
    trainer.fit(LitMLP())
    assert [e.step for e in events(tmp_path / "layerwatch").Scalars("layerwatch/grad_norm")] == [0, 3]


def test_resume_continues_the_schedule_without_repeats(tmp_path, events):
    first = make_trainer(tmp_path, [InspectCallback(every_n_steps=2)], max_steps=5)
    first.fit(LitMLP())
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert {k: v for k, v in saved.items() if "InspectCallback" in k} == {"InspectCallback": {"last_written_step": 4}}

    second = make_trainer(tmp_path, [InspectCallback(every_n_steps=2)], max_steps=10)
    second.fit(LitMLP(), ckpt_path=ckpt)
    steps = sorted(e.step for e in events(second.logger.log_dir).Scalars("weights_norm/net.0.weight"))
    assert steps == [0, 2, 4, 6, 8]


def test_a_resumed_run_goes_on_with_the_overhead_budgets_interval(tmp_path, events, monkeypatch):
    monkeypatch.setattr(Pacer, "ideal", scripted_ideal(lambda: 3.0))  # every 5 steps
    first = make_trainer(tmp_path, [InspectCallback()], max_steps=12)
    first.fit(LitMLP())
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["InspectCallback"]
    assert saved == {"last_written_step": 10, "sample_interval": 5}

    monkeypatch.setattr(Pacer, "ideal", scripted_ideal(lambda: 15.0))  # now every 20
    second = make_trainer(tmp_path, [InspectCallback()], max_steps=30)
    second.fit(LitMLP(), ckpt_path=ckpt)
    logged = {e.step: e.value for e in events(second.logger.log_dir).Scalars("layerwatch/sample_interval")}
    # Resumed at 12 with its interval: no early samples (12, 13), and 15's cost is left out (the
    # first sample of a run pays one-off costs), so 20 is where the new measurements count.
    assert logged == {0: 1, 1: 5, 5: 5, 10: 5, 15: 5, 20: 20}


def test_a_resumed_callback_never_rewrites_a_written_step(tmp_path, events):
    callback = InspectCallback(every_n_steps=1)
    callback.load_state_dict({"last_written_step": 3})
    trainer = make_trainer(tmp_path, [callback], max_steps=5)
    trainer.fit(LitMLP())
    assert [e.step for e in events(trainer.logger.log_dir).Scalars("layerwatch/grad_norm")] == [4]


def test_hooks_are_gone_and_user_exceptions_pass_through(tmp_path):
    class Boom(Exception):
        pass

    class Exploding(LitMLP):
        def training_step(self, batch, batch_idx):
            if self.global_step == 3:
                raise Boom("step 3")
            return super().training_step(batch, batch_idx)

    model = Exploding()
    trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=1)])
    with pytest.raises(Boom, match="step 3"):
        trainer.fit(model)
    optimizer = trainer.optimizers[0]
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(every_n_steps=0), "every_n_steps must be an int >= 1, got 0"),
     (dict(stats=("median",)), "stats: unknown value 'median'"),
     (dict(histogram_bins=300), "got 300")],
)
def test_bad_options_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InspectCallback(**kwargs)


def test_the_same_callback_twice_is_refused(tmp_path):
    callback = InspectCallback()
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `InspectCallback`"):
        make_trainer(tmp_path, [callback, callback])  # Lightning refuses it when the Trainer is built


def test_works_with_the_pytorch_lightning_package(tmp_path, events):
    pl = pytest.importorskip("pytorch_lightning")

    class PLModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(dataset(), batch_size=8)

    logger = pl.loggers.TensorBoardLogger(tmp_path, name="pl", version=0)
    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=4, logger=logger,
                         callbacks=[InspectCallback(every_n_steps=2)], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(PLModule())
    acc = events(logger.log_dir)
    assert [e.step for e in acc.Scalars("grads_norm/net.weight")] == [0, 2]
    assert "train_loss" in acc.Tags()["scalars"]
    assert not math.isnan(acc.Scalars("layerwatch/grad_norm")[0].value)


def test_two_optimizers_each_have_their_gradients_read_at_their_own_step(tmp_path, events):
    from models import LitGAN

    module = LitGAN()
    trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=1)], max_steps=8)
    trainer.fit(module)
    acc = events(trainer.logger.log_dir)
    for name in ("gen.0.weight", "gen.2.bias"):
        logged = {e.step: e.value for e in acc.Scalars(f"grads_norm/{name}")}
        assert 0 in logged  # read at step 0 too, not only from the batch after
        for step, value in logged.items():
            assert value == pytest.approx(module.gen_grad_norms[step][name], rel=1e-6), (name, step)


def test_a_warning_during_fit_does_not_break_the_progress_bar_line(tmp_path, monkeypatch):
    import contextlib
    import io
    import re
    import sys
    import warnings

    from layerwatch.sinks.tensorboard import TensorBoardSink

    write = TensorBoardSink.write

    def failing_at_step_3(self, rec):
        if rec.step == 3:
            raise OSError("disk full")
        return write(self, rec)

    monkeypatch.setattr(TensorBoardSink, "write", failing_at_step_3)
    screen = io.StringIO()  # one terminal: the bar (stdout) and the warning (stderr) interleave
    with contextlib.redirect_stdout(screen), contextlib.redirect_stderr(screen), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line)
        )  # printed, as outside pytest
        trainer = make_trainer(tmp_path, [InspectCallback(every_n_steps=1)], enable_progress_bar=True)
        trainer.fit(LitMLP())
    text = screen.getvalue()
    found = re.search(r"([^\r\n]*?)(\S+\.py):\d+: (?:RuntimeWarning: )?layerwatch: could not write", text)
    assert found, repr(text[-3000:])
    assert found.group(1) == "", repr(found.group(0))  # it starts its own line
    assert found.group(2) == __file__  # and points at the test's own line, not inside layerwatch


def test_an_moe_module_gets_its_routers_at_each_sampled_step(tmp_path):
    """A LightningModule holding a transformers Mixtral: the callback finds its routers (under
    the module's own name for the model) and logs each sampled step's routing, every token once
    per expert it went to."""
    import layerwatch
    from models import LitMoE

    make_trainer(tmp_path, [InspectCallback(every_n_steps=2)], max_steps=4).fit(LitMoE())
    frame = layerwatch.load(tmp_path / "tb" / "version_0")
    tokens = frame[frame.series == "moe_tokens"]
    assert sorted(tokens.step.unique()) == [0, 2]
    routers = tokens.layer.str.rpartition("#")[0]
    assert sorted(routers.unique()) == ["model.model.layers.0.mlp.gate", "model.model.layers.1.mlp.gate"]
    assert tokens.groupby(["step", routers]).value.sum().unique().tolist() == [4 * 8 * 2]
    entropy = frame[frame.series == "moe_entropy"]
    assert len(entropy) == 4 and entropy.value.between(0, math.log(4)).all()
