"""How large a shared file (``layerwatch report LOGDIR --html OUT``) is, how long it takes to
write, and how fast it opens, in headless chromium from file:// with every request refused.

Two runs:

- ``demo``: the run of ``layerwatch demo`` at its defaults (8,000 steps sampled every 50: 160
  samples of 17 statistics, with histograms). Training it takes minutes: ``--demo LOGDIR``
  reuses one already written;
- ``scale``: the tab's scale run (``benchmarks/tab_scale.py``: ``--layers`` x ``--samples``,
  gradient and weight norms, forward ms and NaN flags of every layer), written here.

For each: the file's size, the time ``layerwatch report --html`` took, and ``first paint``:
from the navigation to the heatmap drawn (the page's ``body[data-heatmap-ms]``), over
``--rounds`` fresh pages; ``heatmap`` is the page's own measure of its heatmap's request to
drawn (unpacking the inline data included on the first request).

    python benchmarks/share_size.py [--demo runs/layerwatch-demo] [--layers 1000 --samples 500]
        [--every-nth N]

Needs playwright (``pip install playwright``) and a chromium on the PATH.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_file(logdir: Path, out: Path, every_nth: int | None) -> float:
    from layerwatch.cli import main

    argv = ["report", str(logdir), "--html", str(out)] + (["--every-nth", str(every_nth)] if every_nth else [])
    started = time.perf_counter()
    if main(argv) != 0:
        raise SystemExit(f"layerwatch {' '.join(argv)} failed")
    return time.perf_counter() - started


def first_paint(path: Path, rounds: int) -> list[tuple[float, float]]:
    """(navigation to heatmap drawn, the page's heatmap ms) per round, in seconds."""
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        for _ in range(rounds):
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.route("**/*", lambda route: route.continue_() if route.request.url == path.as_uri() else route.abort())
            started = time.perf_counter()
            page.goto(path.as_uri())
            page.wait_for_selector("body[data-heatmap-ms]", timeout=120_000)
            out.append((time.perf_counter() - started, float(page.evaluate("document.body.dataset.heatmapMs")) / 1e3))
            page.close()
        browser.close()
    return out


def measure(name: str, logdir: Path, out: Path, every_nth: int | None, rounds: int) -> None:
    took = write_file(logdir, out, every_nth)
    paints = first_paint(out, rounds)
    print(f"{name}: {out.stat().st_size / 2**20:.2f} MiB ({out.stat().st_size:,} bytes), written in {took:.1f} s; "
          + "; ".join(f"first paint {paint:.2f} s (heatmap {heatmap:.2f} s)" for paint, heatmap in paints))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, default=None, help="a `layerwatch demo` log directory (else trained here)")
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--every-nth", type=int, default=None, help="pass --every-nth N for the scale run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        demo = args.demo
        if demo is None:
            from layerwatch.demo import run_demo

            demo = tmp / "demo"
            run_demo(log_dir=str(demo))
        measure("demo", demo, tmp / "demo.html", None, args.rounds)
        from tab_scale import write_run

        write_run(tmp / "scale" / "big", args.layers, args.samples)
        nth = f", --every-nth {args.every_nth}" if args.every_nth else ""
        measure(f"scale ({args.layers} layers x {args.samples} samples{nth})", tmp / "scale", tmp / "scale.html",
                args.every_nth, args.rounds)


if __name__ == "__main__":
    main()
