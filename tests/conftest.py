"""The fixtures every test file may ask for."""

from __future__ import annotations

from pathlib import Path

import pytest
from event_logs import read_events


@pytest.fixture
def benchmarks(monkeypatch):
    """Makes the modules of ``benchmarks/`` (workloads, timing, overhead, ...) importable."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture
def events():
    return read_events
