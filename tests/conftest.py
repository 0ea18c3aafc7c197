"""The fixtures every test file may ask for."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from event_logs import read_events

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def benchmarks(monkeypatch):
    """Makes the modules of ``benchmarks/`` (workloads, timing, overhead, ...) importable."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture
def events():
    return read_events


@pytest.fixture(scope="module")
def browser():
    """Headless chromium driven by Playwright, one per test file; skipped without either
    (``.ci/run`` installs Debian's chromium)."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if CHROMIUM is None:
        pytest.skip("no chromium on the PATH (apt-get install chromium)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def demo_logs(tmp_path_factory):
    """The demo's run, its NaN at step ``INJECT`` and its loss spike at ``SPIKE`` (``browser_runs``),
    written once per test file."""
    from browser_runs import INJECT, SPIKE
    from layerwatch.demo import run_demo

    logdir = tmp_path_factory.mktemp("demo")
    with pytest.warns(RuntimeWarning):
        run_demo(steps=200, log_dir=str(logdir), every=10, inject_nan=INJECT, batch=32, inject_spike=SPIKE)
    return logdir
