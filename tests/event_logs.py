"""Reading back what a run wrote, with TensorBoard's own loader (the ``events`` fixture)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_events(log_dir: Path | str) -> EventAccumulator:
    """Every scalar, histogram and tensor under ``log_dir``, none sampled away."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc
