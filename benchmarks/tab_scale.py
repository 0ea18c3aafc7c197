"""How fast the LAYERWATCH tab opens a large run, measured in a real browser.

Writes a run of ``--layers`` layers x ``--samples`` sampled steps of the tab's data (the
encoder layerwatch uses in training, ``sinks/plugin_data.py``: per-layer gradient norms, weight
norms, forward ms and NaN flags), serves it with TensorBoard (the Python reader, and the Rust
data server with ``--load-fast``), opens the tab in headless chromium and reports:

- ``heatmap``: from the heatmap's request to the end of its drawing, as the page measures it
  (``document.body.dataset.heatmapMs``): fetch, decode and draw;
- ``open``: from navigating to TensorBoard's URL with the tab selected to the heatmap drawn,
  TensorBoard's own page start-up (until it creates the tab's frame) included and shown apart.

    python benchmarks/tab_scale.py --layers 1000 --samples 2000 [--load-fast]

Needs playwright (``pip install playwright``) and a chromium on the PATH.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def write_run(logdir: Path, layers: int, samples: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from layerwatch.sinks.record import StepRecord
    from layerwatch.sinks import event_file as events
    from layerwatch.sinks.plugin_data import PluginData

    rng = np.random.default_rng(0)
    modules = [f"blocks.{i // 4}.{('attn', 'norm', 'mlp.fc1', 'mlp.fc2')[i % 4]}" for i in range(layers)]
    params = [f"{m}.weight" for m in modules]
    writer, plugin = SummaryWriter(str(logdir)), PluginData()
    base = rng.lognormal(0, 1, layers)
    for k in range(samples):
        grads = base * (1 + 0.1 * rng.standard_normal(layers))
        scalars = {f"grads_norm/{n}": v for n, v in zip(params, grads.tolist())}
        scalars.update({f"weights_norm/{n}": v for n, v in zip(params, (3 * base).tolist())})
        scalars.update({f"fwd_ms/{n}": v for n, v in zip(modules, (0.01 * grads).tolist())})
        scalars.update({f"nonfinite/{n}": 0.0 for n in modules})
        payload = plugin.encode(StepRecord(10 * k, scalars=scalars))
        if not events.append(writer, [events.event(time.time(), 10 * k, payload)]):
            raise SystemExit("needs google-crc32c (the C CRC32C) to write this run quickly")
    writer.close()


def measure(logdir: Path, samples: int, load_fast: bool, rounds: int) -> list[tuple[float, float, float]]:
    from playwright.sync_api import sync_playwright

    from tb_server import open_tab, serve

    def loaded(server):
        runs = server.get_json("/data/plugin/layerwatch/runs")["runs"]
        return bool(runs) and runs[0]["samples"] == samples

    out = []
    with serve(logdir, load_fast=load_fast, ready=loaded, timeout=600) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        for _ in range(rounds):
            started = time.perf_counter()
            page, frame = open_tab(browser, server.url, timeout_ms=120_000, ready="body")
            shell = time.perf_counter() - started
            frame.wait_for_selector("body[data-heatmap-ms]", timeout=120_000)
            opened = time.perf_counter() - started
            heatmap_ms = float(frame.evaluate("() => document.body.dataset.heatmapMs"))
            out.append((heatmap_ms / 1e3, shell, opened))
            page.close()
        browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-fast", action="store_true", help="TensorBoard's Rust data server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logdir = Path(tmp)
        started = time.perf_counter()
        write_run(logdir / "big", args.layers, args.samples)
        size = sum(f.stat().st_size for f in logdir.rglob("*tfevents*"))
        print(f"wrote {args.layers} layers x {args.samples} samples ({size / 2**20:.0f} MiB) "
              f"in {time.perf_counter() - started:.1f} s")
        times = measure(logdir, args.samples, args.load_fast, args.rounds)
    reader = "Rust data server (--load_fast)" if args.load_fast else "Python reader"
    for i, (heatmap, shell, opened) in enumerate(times):
        print(f"{reader}, round {i + 1}: heatmap {heatmap:.2f} s (request to drawn); open {opened:.2f} s "
              f"(navigation to drawn, of which {shell:.2f} s TensorBoard's page until the tab's frame)")


if __name__ == "__main__":
    main()
