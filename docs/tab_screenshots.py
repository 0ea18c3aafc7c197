"""The LAYERWATCH tab's pictures in docs/img, from a TensorBoard serving the demo's three runs
(version_0 healthy, version_1 with --inject-nan, version_2 with --inject-spike). Called by
docs/screenshots.sh:

    python docs/tab_screenshots.py http://127.0.0.1:6123 docs/img [PICTURES]

PICTURES: a comma-separated list of layer-view, spike (default: both).
"""

import shutil
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tb_server import open_tab  # noqa: E402

url, out = sys.argv[1], sys.argv[2]
pictures = sys.argv[3].split(",") if len(sys.argv) > 3 else ["layer-view", "spike"]


def show(frame, run, stat="grads_norm", compare=""):
    frame.evaluate("() => delete document.body.dataset.heatmapMs")
    frame.select_option("#lw-run", run)
    frame.wait_for_function("() => document.body.dataset.heatmapMs !== undefined")
    if stat != "grads_norm":
        frame.select_option("#lw-stat", stat)
        frame.wait_for_selector(f'#lw-heatmap[data-stat="{stat}"]')
    if compare:
        frame.select_option("#lw-compare", compare)
        frame.wait_for_selector("#lw-heatmap-compare[data-rows]")
    frame.wait_for_timeout(300)


with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
    if "layer-view" in pictures:
        page, frame = open_tab(browser, url)
        show(frame, "demo/version_1")
        page.screenshot(path=f"{out}/layer-view.png")
        frame.locator('.lw-row-label[data-name="encoder.2.weight"]').first.click()
        frame.wait_for_selector('#lw-detail[data-layer="encoder.2.weight"]')
        frame.wait_for_timeout(300)
        frame.locator("#lw-detail").scroll_into_view_if_needed()
        page.screenshot(path=f"{out}/layer-view-detail.png")
        page.close()
        page, frame = open_tab(browser, url)
        show(frame, "demo/version_0", stat="fwd_ms")
        page.screenshot(path=f"{out}/layer-view-latency.png")
        page.close()
    if "spike" in pictures:
        page, frame = open_tab(browser, url)
        show(frame, "demo/version_2", stat="activations_norm")
        page.screenshot(path=f"{out}/spike.png")
        page.close()
    browser.close()
