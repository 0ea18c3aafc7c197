"""The pictures of docs/reading-charts.md's "Before a divergence" and docs/alerts.md's calibration:
two runs of benchmarks/divergence.py's suite (a Llama learning the grammar task whose learning rate
climbs until it fails, and its healthy twin), sampled every 10 steps, in the LAYERWATCH tab: each
signal of the failing run, its alerts marked, beside the healthy run's.

    python docs/divergence_screenshots.py [--out docs/img]

Needs chromium (Debian's) and the dev extra (Playwright).
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "tests"), str(root / "benchmarks")]
import divergence  # noqa: E402
from tb_server import open_tab, serve  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--out", type=Path, default=root / "docs" / "img")
args = parser.parse_args()
logdir = Path(tempfile.mkdtemp(prefix="divergence-"))
for twin, name in (("ramp", "diverging"), ("healthy", "safe")):
    divergence.run("grammar", "llama", twin, "every 10", log_dir=logdir / name)
with serve(logdir, ready=lambda s: len(s.get_json("/data/plugin/layerwatch/runs")["runs"]) == 2) as server, sync_playwright() as p:
    time.sleep(20)  # TensorBoard reads the runs' events a while after it lists them
    browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
    for stat, picture in (("attention_logit_max", "divergence-attention.png"), ("adam_update_rms", "divergence-update-rms.png"),
                          ("attention_entropy", "divergence-entropy.png")):
        page, frame = open_tab(browser, server.url)
        frame.select_option("#lw-run", "diverging")
        frame.select_option("#lw-stat", stat)
        frame.wait_for_selector(f'#lw-heatmap[data-stat="{stat}"]')
        frame.select_option("#lw-compare", "safe")
        frame.wait_for_selector("#lw-heatmap-compare[data-rows]")
        frame.wait_for_timeout(500)
        page.screenshot(path=str(args.out / picture))
        page.close()
    browser.close()
print(f"pictures in {args.out}")
