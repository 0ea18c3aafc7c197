"""A real TensorBoard server over a finished run serves what we wrote through its HTTP data API."""

import pytest

import lightning.pytorch as L
from lightning.pytorch.loggers import TensorBoardLogger

from layerwatch import InspectCallback
from models import LitMLP
from tb_server import serve


@pytest.fixture
def finished_run(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=logger, callbacks=[InspectCallback(every_n_steps=2)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, default_root_dir=tmp_path)
    trainer.fit(LitMLP())
    return tmp_path


def test_tensorboard_serves_our_scalars_and_histograms(finished_run):
    run = "run/version_0"
    loaded = lambda server: server.get_json("/data/plugin/scalars/tags").get(run, {}).get("layerwatch/grad_norm")
    with serve(finished_run, ready=loaded) as server:
        scalar_tags = server.get_json("/data/plugin/scalars/tags")
        assert {"train_loss", "layerwatch/grad_norm", "weights_norm/net.0.weight"} <= set(scalar_tags[run])
        histogram_tags = server.get_json("/data/plugin/histograms/tags")[run]
        assert {"weights/net.0.weight", "grads/net.2.bias"} <= set(histogram_tags)
        series = server.get_json("/data/plugin/histograms/histograms", run=run, tag="weights/net.0.weight")
        assert [step for _, step, _ in series] == [0, 2, 4]
        for _, _, buckets in series:
            assert sum(count for _, _, count in buckets) == pytest.approx(8 * 16)
            assert all(left <= right for left, right, _ in buckets)
        norms = server.get_json("/data/plugin/scalars/scalars", run=run, tag="weights_norm/net.0.weight")
        assert [step for _, step, _ in norms] == [0, 2, 4]
