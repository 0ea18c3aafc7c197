"""The picture of the tab's experts view (docs/img/moe-experts.png): a tiny Mixtral (4 layers of 8
experts, top-2, trained with its load-balancing loss) trained 40 steps and sampled every 2, healthy
beside the same run whose first router collapses onto expert 0 from step 20 (a forward hook adds 30
to that expert's logit and routes by it: tests/moe_runs.py), each run's experts view at its last
sample, side by side. Called by docs/screenshots.sh:

    python docs/moe_screenshot.py docs/img

With --report, it also prints `layerwatch report` of the two runs (docs/moe.md quotes it).
"""

import base64
import shutil
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from moe_runs import train_mixtral  # noqa: E402
from tb_server import open_tab, serve  # noqa: E402

out = sys.argv[1]
STEPS, EVERY, COLLAPSE_FROM = 40, 2, 20
RUNS = {"healthy": None, "collapsing": COLLAPSE_FROM}
CAPTIONS = {"healthy": "healthy: every expert near 1/8 of its router's picks, imbalance 1.3-1.5",
            "collapsing": f"collapsing: model.layers.0.mlp.gate pushed onto expert 0 from step {COLLAPSE_FROM}"}


def experts_view(browser, url: str, run: str) -> bytes:
    page, frame = open_tab(browser, url)
    page.set_viewport_size({"width": 1120, "height": 1000})
    frame.select_option("#lw-run", run)
    frame.wait_for_selector(f'#lw-experts .lw-hm-card[data-step="{STEPS - EVERY}"]', timeout=30_000)
    frame.wait_for_function(f"() => document.querySelector('#lw-experts .lw-hm-run').textContent === '{run}'")
    frame.wait_for_timeout(300)
    picture = frame.locator("#lw-experts").screenshot()
    page.close()
    return picture


with tempfile.TemporaryDirectory() as logdir:
    for run, collapse_from in RUNS.items():
        train_mixtral(Path(logdir) / run, steps=STEPS, every=EVERY, collapse_from=collapse_from, layers=4,
                      batch=(8, 32))
    if "--report" in sys.argv:
        from layerwatch.cli import main

        main(["report", logdir])

    def loaded(server):
        runs = server.get_json("/data/plugin/layerwatch/runs")["runs"]
        return len(runs) == len(RUNS) and all(run["last_step"] == STEPS - EVERY for run in runs)

    with serve(Path(logdir), ready=loaded) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        pictures = {run: experts_view(browser, server.url, run) for run in RUNS}
        page = browser.new_page(viewport={"width": 800, "height": 400})
        figures = "".join(
            f'<figure><figcaption>{CAPTIONS[run]}</figcaption>'
            f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}"></figure>' for run, png in pictures.items())
        page.set_content('<html><body style="margin:0;background:#f5f5f5;font:13px Roboto,system-ui,sans-serif">'
                         '<div id="both" style="display:flex;gap:12px;padding:8px;width:max-content">'
                         f'{figures}</div></body></html>')
        page.add_style_tag(content="figure{margin:0} figcaption{margin:0 0 4px 4px;color:#424242;font-weight:500}")
        page.locator("#both").screenshot(path=f"{out}/moe-experts.png")
        browser.close()
