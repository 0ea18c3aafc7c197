"""The engine and its parts: the step protocol (``engine.Engine``), which steps are sampled
(``sampling``, ``budget``), where parameters live (``placement``) and pipeline stages'
measurements sent to rank 0 (``stages``), a compiled model's eager re-run (``rerun``), a sampled
step's close (``closing``), where the records go (``output``).

``layerwatch.engine.engine.Engine`` is read lazily: importing a part does not import the engine."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name != "Engine":
        raise AttributeError(f"module 'layerwatch.engine' has no attribute {name!r}")
    return importlib.import_module("layerwatch.engine.engine").Engine
