"""The picture of the tab's per-head view (docs/img/layer-view-heads.png): an SdpaLM of 8 heads
a block, trained 80 steps and sampled every 2 (tests/tensorboard_plugin/test_browser_heads.py's run, larger), its
second attention module clicked, with the heads folded in the heatmap of the per-head entropy.
Called by docs/screenshots.sh:

    python docs/heads_screenshot.py docs/img
"""

import shutil
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tb_server import open_tab, serve  # noqa: E402
from browser_runs import RUN, train  # noqa: E402

out = sys.argv[1]
STEPS, EVERY = 80, 2

with tempfile.TemporaryDirectory() as logdir:
    train(Path(logdir) / RUN, steps=STEPS, every=EVERY, heads=8, width=64)

    def loaded(server):
        runs = server.get_json("/data/plugin/layerwatch/runs")["runs"]
        return bool(runs) and runs[0]["last_step"] == STEPS - EVERY

    with serve(Path(logdir), ready=loaded) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page, frame = open_tab(browser, server.url)
        page.set_viewport_size({"width": 1400, "height": 1000})
        frame.select_option("#lw-stat", "attention_head_entropy")
        frame.wait_for_selector('#lw-heatmap[data-stat="attention_head_entropy"]', timeout=30_000)
        frame.locator('.lw-twisty[data-group="blocks.0.attn"]').click()
        frame.locator('.lw-row-label[data-name="blocks.1.attn"]').click()
        frame.wait_for_selector('#lw-detail[data-layer="blocks.1.attn"] #lw-heads', timeout=30_000)
        frame.wait_for_timeout(300)
        frame.locator('#lw-detail[data-layer="blocks.1.attn"] #lw-heads').scroll_into_view_if_needed()
        page.screenshot(path=f"{out}/layer-view-heads.png")
        browser.close()
