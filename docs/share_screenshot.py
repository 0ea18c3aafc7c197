"""docs/img/share-demo.png: the file ``layerwatch report --html`` writes, open from file:// in
headless Chromium with every other request refused, on the forward-time heatmap with the first
offender's layer detail. Called by docs/screenshots.sh:

    python docs/share_screenshot.py docs/img
"""

import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from playwright.sync_api import sync_playwright

from layerwatch.cli import main
from layerwatch.demo import run_demo

out = Path(sys.argv[1])
work = Path(tempfile.mkdtemp())
with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # the injected NaN's warning
    run_demo(steps=200, log_dir=str(work / "runs"), every=10, inject_nan=183, batch=32, inject_spike=166)
page_file = work / "run.html"
assert main(["report", str(work / "runs"), "--html", str(page_file)]) == 0

with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.route("**/*", lambda route: route.continue_() if route.request.url == page_file.as_uri() else route.abort())
    page.goto(page_file.as_uri())
    page.wait_for_selector("#lw-heatmap[data-rows]", timeout=60_000)
    page.select_option("#lw-stat", "fwd_ms")
    page.wait_for_selector('#lw-heatmap[data-stat="fwd_ms"]')
    page.locator('.lw-row-label[data-name="encoder.fault"]').first.click()
    page.wait_for_selector('#lw-detail[data-layer="encoder.fault"]')
    page.wait_for_timeout(300)
    page.screenshot(path=str(out / "share-demo.png"))
    browser.close()
