"""A real TensorBoard server over a finished run serves what we wrote through its HTTP data API."""

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

import lightning.pytorch as L
from lightning.pytorch.loggers import TensorBoardLogger

from layerwatch import InspectCallback
from lightning_models import LitMLP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port: int, path: str, **params):
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}{query}", timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def finished_run(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=logger, callbacks=[InspectCallback(every_n_steps=2)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, default_root_dir=tmp_path)
    trainer.fit(LitMLP())
    return tmp_path


def test_tensorboard_serves_our_scalars_and_histograms(finished_run):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(finished_run), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        scalar_tags: dict = {}
        while time.monotonic() < deadline:
            try:
                scalar_tags = get_json(port, "/data/plugin/scalars/tags")
                if scalar_tags.get("run/version_0", {}).get("layerwatch/grad_norm"):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        run = "run/version_0"
        assert {"train_loss", "layerwatch/grad_norm", "weights_norm/net.0.weight"} <= set(scalar_tags[run])
        histogram_tags = get_json(port, "/data/plugin/histograms/tags")[run]
        assert {"weights/net.0.weight", "grads/net.2.bias"} <= set(histogram_tags)
        series = get_json(port, "/data/plugin/histograms/histograms", run=run, tag="weights/net.0.weight")
        assert [step for _, step, _ in series] == [0, 2, 4]
        for _, _, buckets in series:
            assert sum(count for _, _, count in buckets) == pytest.approx(8 * 16)
            assert all(left <= right for left, right, _ in buckets)
        norms = get_json(port, "/data/plugin/scalars/scalars", run=run, tag="weights_norm/net.0.weight")
        assert [step for _, step, _ in norms] == [0, 2, 4]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
