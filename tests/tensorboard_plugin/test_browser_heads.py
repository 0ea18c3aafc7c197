"""The LAYERWATCH tab's attention heads in a real browser (as test_browser.py: Debian's chromium,
driven by Playwright, over a real TensorBoard server): heads folded into their module's row,
and a module's heads x steps in its layer detail. Skipped when no chromium is installed."""

from __future__ import annotations

import shutil

import pytest

from browser_runs import EVERY, HEADS, RUN, STEPS, train
from tb_server import open_tab, serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on the PATH (apt-get install chromium)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("heads")
    train(logdir / RUN)

    def loaded(server):
        runs = server.get_json("/data/plugin/layerwatch/runs")["runs"]
        return bool(runs) and runs[0]["last_step"] == STEPS - EVERY

    with serve(logdir, ready=loaded) as server:
        yield server


def show(frame, stat):
    frame.select_option("#lw-stat", stat)
    frame.wait_for_selector(f'#lw-heatmap[data-stat="{stat}"]', timeout=30_000)


def test_heads_are_folded_into_their_module_until_expanded(browser, server):
    page, frame = open_tab(browser, server.url)
    show(frame, "attention_head_logit_max")
    heatmap = frame.locator("#lw-heatmap")
    assert heatmap.get_attribute("data-rows") == "2"  # blocks.0.attn and blocks.1.attn, each its heads' largest
    folded = frame.locator('.lw-row-label[data-name="blocks.0.attn"]')
    assert f"×{HEADS}" in folded.inner_text()
    frame.locator('.lw-twisty[data-group="blocks.0.attn"]').click()
    frame.wait_for_selector(f'#lw-heatmap[data-rows="{HEADS + 1}"]', timeout=10_000)
    labels = frame.locator(".lw-row-label").evaluate_all("(rows) => rows.map((row) => row.dataset.name)")
    assert labels == [f"blocks.0.attn#{h}" for h in range(HEADS)] + ["blocks.1.attn"]  # the heads under their module
    assert frame.locator('.lw-row-label[data-name="blocks.0.attn#2"]').inner_text().endswith("#2")
    show(frame, "attention_head_entropy")  # the other per-head stat: the same module, unfolded as left
    assert heatmap.get_attribute("data-rows") == str(HEADS + 1)
    frame.locator("#lw-expand-all").click()
    frame.wait_for_selector(f'#lw-heatmap[data-rows="{2 * HEADS}"]', timeout=10_000)
    page.close()


def test_an_attention_module_shows_its_heads_and_a_head_its_series(browser, server, tmp_path):
    page, frame = open_tab(browser, server.url)
    show(frame, "attention_logit_max")
    frame.locator('.lw-row-label[data-name="blocks.1.attn"]').click()
    detail = frame.locator('#lw-detail[data-layer="blocks.1.attn"]')
    detail.wait_for(timeout=30_000)
    heads = detail.locator("#lw-heads .lw-heads")
    assert heads.evaluate_all("(figures) => figures.map((f) => f.dataset.key)") == [
        "attention_head_logit_max", "attention_head_entropy"]
    for figure in heads.all():
        assert figure.get_attribute("data-heads") == str(HEADS)
        assert figure.get_attribute("data-steps") == str(STEPS // EVERY)
        assert figure.locator(".lw-head-label").evaluate_all("(rows) => rows.map((row) => row.textContent)") == [
            f"#{h}" for h in range(HEADS)]
        assert figure.locator(".lw-legend-bar").count() == 1
    # the readout: the head, step and value under the pointer
    canvas = heads.first.locator("canvas.lw-heads-canvas")
    box = canvas.bounding_box()
    row_height = frame.locator(".lw-head-label").first.bounding_box()["height"]
    canvas.hover(position={"x": box["width"] - 2, "y": 2.5 * row_height})
    readout = heads.first.locator(".lw-readout").inner_text()
    assert readout.startswith(f"head 2 · step {STEPS - EVERY}: ") and readout[-1].isdigit()
    detail.scroll_into_view_if_needed()
    heads.first.scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / "layer-view-heads.png"))
    # a head's own series, with a link back to its module
    heads.first.locator('.lw-head-label[data-name="blocks.1.attn#3"]').click()
    head = frame.locator('#lw-detail[data-layer="blocks.1.attn#3"]')
    head.wait_for(timeout=30_000)
    text = head.inner_text()
    assert "largest attention logit, per head" in text and "attention entropy, per head" in text
    assert head.locator("#lw-heads").count() == 0  # a head has no heads
    head.locator('.lw-layer-link[data-layer="blocks.1.attn"]').click()
    frame.wait_for_selector('#lw-detail[data-layer="blocks.1.attn"] #lw-heads', timeout=30_000)
    page.close()


def test_a_layer_without_heads_shows_no_heads_section(browser, server):
    page, frame = open_tab(browser, server.url)
    frame.locator('.lw-row-label[data-name="blocks.0.attn.q.weight"]').first.click()
    detail = frame.locator('#lw-detail[data-layer="blocks.0.attn.q.weight"]')
    detail.wait_for(timeout=30_000)
    assert "gradient norm" in detail.inner_text() and detail.locator("#lw-heads").count() == 0
    page.close()
