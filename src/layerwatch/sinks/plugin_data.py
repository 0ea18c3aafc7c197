"""The LAYERWATCH tab's data: compact per-step summaries under the plugin's own name.

A model of 1,000 layers writes thousands of scalar tags; listing and reading them one by one
is what makes TensorBoard slow on such runs. So each sampled step also writes a few tensors
owned by the ``layerwatch`` plugin, which TensorBoard's data provider reads (the Python
reader, ``--load_fast`` and the Rust data server alike). The format is
:mod:`layerwatch.vocabulary`'s; its reader is :mod:`layerwatch.reading.events`.

Every value of the step is here, including the ones that do not become TensorBoard cards
(:class:`~layerwatch.sinks.record.CardFilter`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from layerwatch.sinks import record as R
from layerwatch import vocabulary as V
from layerwatch.vocabulary import EVENTS, LAYOUT, PLUGIN_NAME, SERIES


_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=b"1"),
    data_class=summary_pb2.DATA_CLASS_TENSOR,
)


def per_layer_series(scalars: dict[str, float]) -> dict[str, tuple[list[str], np.ndarray]]:
    """The step's per-layer scalars by series: ``{"grads_norm": (names, values)}``, in the
    record's (model) order. Run-wide tags and ``calls/`` (written only above 1) are left out."""
    split, values = R.scalar_values(scalars)
    return {key: (names, values[indices]) for key, (names, indices) in split.series.items()}


class PluginData:
    """Encodes records for the tab. Each series' layer names only grow: a layer seen for the
    first time is placed beside its relatives and the layout is written again; a layer absent
    from a step reads -inf there."""

    def __init__(self) -> None:
        self._names: dict[str, list[str]] = {}
        self._positions: dict[str, dict[str, int]] = {}

    def encode(self, record: R.StepRecord) -> bytes:
        """Serialized ``Summary.Value`` entries (they concatenate into the step's ``Summary``)."""
        series = per_layer_series(record.scalars)
        values = []
        grown = [self._grow(key, names) for key, (names, _) in series.items()]
        if any(grown):
            values.append(_string(LAYOUT, json.dumps({"series": self._names})))
        for key, (names, vals) in series.items():
            if names == self._names[key]:
                row = vals.astype("<f4")
            else:
                row = np.full(len(self._names[key]), -np.inf, dtype="<f4")
                positions = self._positions[key]
                row[[positions[name] for name in names]] = vals
            values.append(_floats(SERIES + key, row))
        values += [_string(EVENTS + key, json.dumps(event)) for key, event in record_events(record).items()]
        return summary_pb2.Summary(value=values).SerializeToString()

    def _grow(self, key: str, names: list[str]) -> bool:
        """Add the names ``key`` has not seen; True when there were any."""
        known = self._names.setdefault(key, [])
        positions = self._positions.setdefault(key, {})
        new = [name for name in names if name not in positions]
        if not new:
            return False
        if not known:
            known.extend(names)
        else:
            for name in new:
                known.insert(_place(known, name), name)
        positions.clear()
        positions.update({name: i for i, name in enumerate(known)})
        return True


def _place(names: list[str], new: str) -> int:
    """Where ``new`` goes in ``names``: after the last name that shares the most leading
    dotted parts with it (``experts.3`` after ``experts.2.w``), so the module tree stays grouped."""
    parts = new.split(".")

    def shared(name: str) -> int:
        n = 0
        for a, b in zip(name.split("."), parts):
            if a != b:
                break
            n += 1
        return n

    best = max(range(len(names)), key=lambda i: (shared(names[i]), i))
    return best + 1 if shared(names[best]) > 0 else len(names)


def record_events(record: R.StepRecord) -> dict[str, Any]:
    """The alerts, first offender, first non-finite step and loss spikes that appear in ``record``, and
    whether its per-module values are of a compiled model's eager re-run."""
    events: dict[str, Any] = {}
    if record.alerts:
        events["alerts"] = [
            {"kind": a.kind, "layer": a.name, "step": a.step, "message": a.message} for a in record.alerts
        ]
    if record.offender is not None:
        events["first_offender"] = {
            "layer": record.offender.name, "step": record.step, "phase": record.offender.phase,
            "text": record.offender.describe(record.step), "replayed_from": record.offender.replayed_from,
        }
    if record.spikes:
        events["spikes"] = record.spikes
    if V.FIRST_NONFINITE_STEP in record.scalars:
        events["first_nonfinite_step"] = int(record.scalars[V.FIRST_NONFINITE_STEP])
    if record.rerun:
        events["rerun"] = True
    return events


def _floats(tag: str, array: np.ndarray) -> summary_pb2.Summary.Value:
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=array.size)]),
        tensor_content=array.tobytes(),
    )
    return summary_pb2.Summary.Value(tag=tag, metadata=_METADATA, tensor=tensor)


def _string(tag: str, text: str) -> summary_pb2.Summary.Value:
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING, tensor_shape=tensor_shape_pb2.TensorShapeProto(), string_val=[text.encode()]
    )
    return summary_pb2.Summary.Value(tag=tag, metadata=_METADATA, tensor=tensor)
