"""docs/img/hf-replay.png: the LAYERWATCH tab of a tiny GPT-2 under the Hugging Face Trainer,
InspectTrainerCallback() at its defaults, with a NaN made by ``transformer.h.1.mlp`` at the
unsampled step 8 (the tests' ``NaNAtStep``): the step found by the sentinel and replayed.
Called by docs/screenshots.sh:

    python docs/hf_screenshot.py docs/img
"""

import shutil
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tb_server import open_tab, serve  # noqa: E402
from test_huggingface import InspectTrainerCallback, train_with_fault  # noqa: E402

out = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as work:
    train_with_fault(Path(work) / "gpt2", [InspectTrainerCallback()])
    with serve(work, ready=lambda server: bool(server.get_json("/data/plugin/layerwatch/runs")["runs"])) as server:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page, frame = open_tab(browser, server.url)
            page.set_viewport_size({"width": 1500, "height": 960})
            frame.wait_for_selector(".lw-event-offender")
            frame.wait_for_timeout(500)
            page.screenshot(path=str(out / "hf-replay.png"))
            browser.close()
