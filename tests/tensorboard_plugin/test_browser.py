"""The LAYERWATCH tab in a real browser: Debian's chromium, driven by Playwright, over a real
TensorBoard server and the demo's run with its NaN incident. Skipped when no chromium is
installed (``.ci/run`` installs it)."""

from __future__ import annotations

import base64
import shutil

import numpy as np
import pytest

from browser_runs import INJECT, SPIKE
from tb_server import open_tab, serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on the PATH (apt-get install chromium)")


@pytest.fixture(scope="module")
def server(demo_logs):
    def loaded(server):
        runs = server.get_json("/data/plugin/layerwatch/runs")["runs"]
        return bool(runs) and runs[0]["last_step"] == 190

    with serve(demo_logs, ready=loaded) as server:
        yield server


def test_the_tab_is_listed_and_its_heatmap_has_a_row_per_layer(browser, server, tmp_path):
    page, frame = open_tab(browser, server.url)
    tabs = page.locator("tab-bar, .mat-mdc-tab, [role=tab]").all_inner_texts()
    assert any(t.strip().upper() == "LAYERWATCH" for t in tabs), tabs
    heatmap = frame.locator("#lw-heatmap")
    assert heatmap.get_attribute("data-stat") == "grads_norm"
    expected = server.get_json("/data/plugin/layerwatch/heatmap", run="demo/version_0", stat="grads_norm")
    assert int(heatmap.get_attribute("data-rows")) == len(expected["rows"])  # every parameter, in model order
    assert int(heatmap.get_attribute("data-steps")) == len(expected["steps"])
    values = np.frombuffer(base64.b64decode(expected["values"]), dtype="<f4").reshape(len(expected["rows"]), -1)
    assert np.isnan(values[:, expected["steps"].index(INJECT)]).all()
    # The marked step is where the NaN was injected, and the offender is the layer that made it.
    assert heatmap.get_attribute("data-first-nonfinite-step") == str(INJECT)
    events = frame.locator("#lw-alerts").inner_text()
    assert "encoder.fault" in events
    offender = frame.locator(".lw-event-offender").inner_text()
    assert "encoder.fault" in offender and f"@ step {INJECT}" in offender and f"replayed from step {INJECT}" in offender
    assert float(frame.evaluate("() => document.body.dataset.heatmapMs")) > 0
    # The loss spike: a line at its step, and listed with the layer it began at, replayed.
    assert heatmap.get_attribute("data-spike-steps") == str(SPIKE)
    assert f"spike @ {SPIKE}" in frame.locator(".lw-hm-marks").first.inner_text()
    spikes = frame.locator("#lw-spikes").inner_text()
    assert "began at encoder.fault" in spikes and "replayed" in spikes and f"@ {SPIKE}" in spikes
    page.screenshot(path=str(tmp_path / "layer-view.png"))
    page.close()


def test_clicking_a_row_opens_its_series_and_histograms(browser, server):
    page, frame = open_tab(browser, server.url)
    frame.locator('.lw-row-label[data-name="encoder.2.weight"]').first.click()
    detail = frame.locator('#lw-detail[data-layer="encoder.2.weight"]')
    detail.wait_for(timeout=30_000)
    text = detail.inner_text()
    assert "gradient norm" in text and "weights/encoder.2.weight" in text
    assert detail.locator("canvas, svg").count() >= 2  # a series chart and a histogram over time
    page.close()


def test_the_statistic_and_the_run_can_be_chosen(browser, server):
    page, frame = open_tab(browser, server.url)
    frame.select_option("#lw-stat", "fwd_ms")
    frame.wait_for_selector('#lw-heatmap[data-stat="fwd_ms"]', timeout=30_000)
    modules = server.get_json("/data/plugin/layerwatch/heatmap", run="demo/version_0", stat="fwd_ms")["rows"]
    assert int(frame.locator("#lw-heatmap").get_attribute("data-rows")) == len(modules)
    assert frame.locator("#lw-rankings").inner_text().count("Slowest") == 1
    page.close()


def test_a_logdir_without_layerwatch_data_shows_the_empty_state(browser, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "plain"))
    writer.add_scalar("loss", 1.0, 0)
    writer.close()
    with serve(tmp_path, ready=lambda s: "plain" in s.get_json("/data/plugin/scalars/tags")) as server:
        page, frame = open_tab(browser, server.url, ready="#lw-empty")
        empty = frame.locator("#lw-empty")
        assert "InspectCallback" in empty.inner_text()
        page.goto(f"{server.url}/#timeseries")  # the other tabs still work
        page.wait_for_selector("text=loss", timeout=60_000)
        page.close()
