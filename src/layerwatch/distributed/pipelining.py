"""Whether ``torch.distributed.pipelining`` runs, and whether the caller runs inside a pipeline
stage's shape inference (:func:`in_shape_inference`): the stage's forward on made-up inputs, run
once before its first micro-batch, which the runtime probes do not count."""

from __future__ import annotations

import functools
import sys
from types import CodeType

PIPELINING = "torch.distributed.pipelining"
STAGE_MODULE = "torch.distributed.pipelining.stage"
# What pipelining runs before the first micro-batch to infer the shapes a stage sends and
# receives: torch 2.13's forward and backward metadata inference, and the forward on meta
# tensors of earlier versions.
SHAPE_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


@functools.cache
def _inference_code() -> frozenset[CodeType]:
    """The code objects of pipelining's shape inference (its stage module is loaded)."""
    stage = sys.modules[STAGE_MODULE]
    return frozenset(
        function.__code__ for cls in vars(stage).values() if isinstance(cls, type)
        for name in SHAPE_INFERENCE for function in [vars(cls).get(name)] if hasattr(function, "__code__")
    )


def in_shape_inference() -> bool:
    """Whether the caller runs inside a pipeline stage's shape inference: the stage's forward
    on inputs made up from their shapes (empty tensors: any values, NaN included), run once
    before its first micro-batch, whose time, calls and values are no step's. A dictionary
    lookup when pipelining is not loaded."""
    if STAGE_MODULE not in sys.modules:
        return False
    codes = _inference_code()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False
