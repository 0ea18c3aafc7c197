"""layerwatch: watch the inside of a PyTorch model while it trains, in TensorBoard."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layerwatch.health.alert import Alert
    from layerwatch.inspector import Inspector
    from layerwatch.lightning import InspectCallback
    from layerwatch.reading.notebook import load, load_alerts, load_experts, load_histograms
    from layerwatch.schedule import Schedule, at_steps, dense_then_every, every_n_steps, windowed
    from layerwatch.options import AlertRules, SpikeRule
    from layerwatch.table.summarize import summarize
    from layerwatch.table.summary import Summary

# Where each public name lives. They are imported when first asked for: TensorBoard imports
# this package to load the LAYERWATCH tab and should not pay for torch (or Lightning) then.
_HOMES = {
    "Inspector": "layerwatch.inspector",
    "InspectCallback": "layerwatch.lightning",
    "load": "layerwatch.reading.notebook",
    "load_histograms": "layerwatch.reading.notebook",
    "load_alerts": "layerwatch.reading.notebook",
    "load_experts": "layerwatch.reading.notebook",
    "summarize": "layerwatch.table.summarize",
    "Summary": "layerwatch.table.summary",
    "AlertRules": "layerwatch.options",
    "Alert": "layerwatch.health.alert",
    "SpikeRule": "layerwatch.options",
    "Schedule": "layerwatch.schedule",
    "every_n_steps": "layerwatch.schedule",
    "at_steps": "layerwatch.schedule",
    "windowed": "layerwatch.schedule",
    "dense_then_every": "layerwatch.schedule",
}
__all__ = [
    "Inspector", "InspectCallback", "load", "load_histograms", "load_alerts", "load_experts", "summarize", "Summary",
    "AlertRules", "Alert", "SpikeRule", "Schedule", "every_n_steps", "at_steps", "windowed", "dense_then_every",
]  # spelled out (not list(_HOMES)) so that tools see what the package exports
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'layerwatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
