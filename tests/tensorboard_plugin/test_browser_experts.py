"""The LAYERWATCH tab's experts view in a real browser (as test_browser.py: Debian's chromium, driven
by Playwright, over a real TensorBoard server): a tiny Mixtral whose first router collapses onto
expert 0 from step ``COLLAPSE_FROM``, shown as routers x experts at a chosen step and as each
router's imbalance over time; and a run without routers, which has no such view. Skipped when no
chromium is installed."""

from __future__ import annotations

import shutil

import pytest

from layerwatch.sinks.record import StepRecord
from layerwatch.sinks.tensorboard import TensorBoardSink
from moe_runs import COLLAPSED, EVERY, EXPERTS, LAYERS, RUN, STEPS, train_mixtral
from tb_server import open_tab, serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on the PATH (apt-get install chromium)")
COLLAPSE_FROM = 10
DENSE = "without-routers"
SAMPLES = STEPS // EVERY


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path_factory.mktemp("experts")
    train_mixtral(logdir / RUN, collapse_from=COLLAPSE_FROM)
    sink = TensorBoardSink(SummaryWriter(str(logdir / DENSE)), owns_writer=True)
    sink.write(StepRecord(0, scalars={"grads_norm/fc.weight": 1.0}))
    sink.close()

    def loaded(server):
        runs = {run["run"]: run for run in server.get_json("/data/plugin/layerwatch/runs")["runs"]}
        return RUN in runs and runs[RUN]["last_step"] == STEPS - EVERY and DENSE in runs

    with serve(logdir, ready=loaded) as server:
        yield server


def cell(frame, canvas_id: str, row: int, col: int, rows: int, cols: int):
    """Clicks the middle of a cell of a heatmap canvas."""
    canvas = frame.locator(f"#{canvas_id}")
    box = canvas.bounding_box()
    canvas.click(position={"x": (col + 0.5) * box["width"] / cols, "y": (row + 0.5) * box["height"] / rows})


def test_a_run_with_routers_shows_its_experts_at_a_step_and_its_imbalance_over_time(browser, server, tmp_path):
    page, frame = open_tab(browser, server.url)
    frame.wait_for_selector("#lw-experts-grid[data-rows]", timeout=30_000)
    grid, imbalance = frame.locator("#lw-experts-grid"), frame.locator("#lw-experts-imbalance")
    assert grid.get_attribute("data-rows") == str(LAYERS) and grid.get_attribute("data-steps") == str(EXPERTS)
    assert imbalance.get_attribute("data-stat") == "moe_imbalance"
    assert imbalance.get_attribute("data-rows") == str(LAYERS) and imbalance.get_attribute("data-steps") == str(SAMPLES)
    card = grid.locator("xpath=ancestor::section")
    assert card.get_attribute("data-step") == str(STEPS - EVERY)  # the last sample first
    labels = card.locator(".lw-row-label").evaluate_all("(rows) => rows.map((row) => row.dataset.name)")
    assert labels == [f"model.layers.{i}.mlp.gate" for i in range(LAYERS)]  # model order, as the heatmap's
    assert "share of its router's tokens" in card.inner_text() and card.locator(".lw-legend-bar").count() == 1
    # the collapsed router's expert 0: half of every step's picks, the brightest cell
    grid.hover(position={"x": 2, "y": 2})
    tooltip = frame.locator(".lw-tooltip").inner_text()
    assert COLLAPSED in tooltip and f"expert 0 · step {STEPS - EVERY}" in tooltip and "expert's share: 0.5" in tooltip
    frame.locator("#lw-experts").screenshot(path=str(tmp_path / "experts.png"))
    # a step clicked in the imbalance over time is the step the grid shows
    cell(frame, "lw-experts-imbalance", 0, 2, LAYERS, SAMPLES)
    frame.wait_for_selector(f'#lw-experts .lw-hm-card[data-step="{2 * EVERY}"]', timeout=10_000)
    grid.hover(position={"x": 2, "y": 2})
    assert "expert's share: 0.5" not in frame.locator(".lw-tooltip").inner_text()  # before the collapse
    frame.locator("#lw-experts-step").fill(str(SAMPLES - 1))  # the slider back to the last sample
    frame.wait_for_selector(f'#lw-experts .lw-hm-card[data-step="{STEPS - EVERY}"]', timeout=10_000)
    # an expert's cell opens that expert's series; a router's label, its experts over time
    cell(frame, "lw-experts-grid", 1, 3, LAYERS, EXPERTS)
    expert = frame.locator('#lw-detail[data-layer="model.layers.1.mlp.gate#3"]')
    expert.wait_for(timeout=30_000)
    assert "tokens per expert" in expert.inner_text() and "expert 3 of" in expert.inner_text()
    card.locator(f'.lw-row-label[data-name="{COLLAPSED}"]').click()
    experts = frame.locator(f'#lw-detail[data-layer="{COLLAPSED}"] #lw-heads .lw-heads')
    experts.first.wait_for(timeout=30_000)
    assert experts.first.get_attribute("data-key") == "moe_tokens"
    assert experts.first.get_attribute("data-heads") == str(EXPERTS)
    assert "EXPERTS" in frame.locator(f'#lw-detail[data-layer="{COLLAPSED}"]').inner_text().upper()
    frame.locator("#lw-detail").screenshot(path=str(tmp_path / "experts-detail.png"))
    page.close()


def test_the_heatmap_folds_a_routers_experts_and_a_run_without_routers_has_no_experts_view(browser, server):
    page, frame = open_tab(browser, server.url)
    frame.wait_for_selector("#lw-experts-grid[data-rows]", timeout=30_000)
    frame.select_option("#lw-stat", "moe_tokens")
    frame.wait_for_selector('#lw-heatmap[data-stat="moe_tokens"]', timeout=30_000)
    assert frame.locator("#lw-heatmap").get_attribute("data-rows") == str(LAYERS)  # each router its experts folded
    assert f"{EXPERTS} experts folded" in frame.locator(f'.lw-hm-card .lw-row-label[data-name="{COLLAPSED}"]').first \
        .get_attribute("title")
    frame.select_option("#lw-run", DENSE)
    frame.wait_for_selector('#lw-heatmap[data-rows="1"]', timeout=30_000)
    assert frame.locator("#lw-experts").is_hidden()
    page.close()
