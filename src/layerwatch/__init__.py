"""layerwatch: watch the inside of a PyTorch model while it trains, in TensorBoard."""

from layerwatch.alerts import Alert, AlertRules
from layerwatch.inspector import Inspector
from layerwatch.schedule import Schedule, at_steps, dense_then_every, every_n_steps, windowed
from layerwatch.structure import Summary, summarize

__all__ = [
    "Inspector",
    "InspectCallback",
    "summarize",
    "Summary",
    "AlertRules",
    "Alert",
    "Schedule",
    "every_n_steps",
    "at_steps",
    "windowed",
    "dense_then_every",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # InspectCallback imports Lightning; only pay for that when it is asked for.
    if name == "InspectCallback":
        from layerwatch.lightning import InspectCallback

        return InspectCallback
    raise AttributeError(f"module 'layerwatch' has no attribute {name!r}")
