"""The layer table: one row per module (:class:`LayerRow`), the :class:`Summary` of them, and
its text, CSV, JSON and DataFrame formats. What fills it is recorded by
:class:`~layerwatch.table.recording.StructureProbe` (hooks on one forward) into a
:class:`Layer` per module; :func:`~layerwatch.table.summarize.summarize` runs that forward.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Union

import torch
from torch import nn

from layerwatch.distributed.sharding import clean_name
from layerwatch.vocabulary import parent

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
DTypeLike = Union[str, torch.dtype]

TensorSpec = tuple[tuple[int, ...], torch.dtype]  # what the table keeps of a tensor: shape and dtype


@dataclass(frozen=True)
class LayerRow:
    """One module of the table. Counts include the module's children; see ``docs/structure.md``."""

    name: str
    type: str
    depth: int
    input_shapes: list[list[int]]
    output_shapes: list[list[int]]
    params: int
    learnable_params: int
    frozen_params: int
    param_bytes: int
    activation_bytes: int
    macs: int
    flops: int
    calls: int
    tied: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Layer:
    """What the probe learns about one module; the rows are computed from these."""

    name: str
    type: str
    depth: int
    own_params: list[tuple[int, torch.dtype, bool]] = field(default_factory=list)  # (numel, dtype, requires_grad)
    tied: dict[str, str] = field(default_factory=dict)  # this module's name of a tied parameter -> its owner's
    calls: int = 0
    flops: int = 0
    inputs: list[TensorSpec] = field(default_factory=list)  # of the first call
    outputs: list[TensorSpec] = field(default_factory=list)  # of the first call
    all_outputs: list[TensorSpec] = field(default_factory=list)  # of every call


class Summary:
    """The per-module table of a model, one row per module in ``named_modules()`` order.

    Rows are found by qualified module name (``summary["encoder.0"]``; the root is ``""``).
    Parameter counts and MACs of a row include its children; a tied parameter counts once,
    under the first module that owns it. A module that is never called itself (a
    ``ModuleList``) shows its children's MACs.
    """

    def __init__(
        self,
        model_type: str,
        layers: list[Layer],
        first_input: Optional[tuple[int, ...]],
        *,
        batch_dim: int = 0,
        scale_to: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.model_type = model_type
        self._layers = layers
        self._first_input = first_input
        self._measured_batch = first_input[batch_dim] if first_input is not None and len(first_input) > batch_dim else None
        self._batch_dim = batch_dim
        self._scale_to = scale_to
        self.dtype = dtype
        self.batch_size = scale_to if scale_to is not None else self._measured_batch
        self.rows = _rows(layers, self._resize, self._bytes, self._macs_scale)
        self._index = {row.name: row for row in self.rows}
        root = self.rows[0]
        self.total_params = root.params
        self.learnable_params = root.learnable_params
        self.frozen_params = root.frozen_params
        self.param_bytes = root.param_bytes
        self.total_macs = root.macs
        self.total_flops = root.flops
        parents = {parent(row.name) for row in self.rows if row.name}
        self.activation_bytes = sum(row.activation_bytes for row in self.rows if row.name not in parents)

    # ------------------------------------------------------------------ views

    def at(self, *, batch_size: Optional[int] = None, dtype: Optional[DTypeLike] = None, batch_dim: int = 0) -> "Summary":
        """The same table at another batch size and/or with floating tensors stored as ``dtype``.

        Nothing is re-run. Batch scaling assumes dimension ``batch_dim`` of a tensor is the
        batch when its size equals the measured batch size, and that MACs grow linearly
        with the batch (true of layers that treat samples independently).

        Raises:
            ValueError: ``batch_size`` is not a positive int, ``batch_dim`` is not a dimension
                of the first input, or ``dtype`` is not one of fp32/fp16/bf16/int8.
        """
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
            if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
                raise ValueError(f"batch_dim must be an int >= 0, got {batch_dim!r}")
            if self._first_input is None or len(self._first_input) <= batch_dim:
                raise ValueError(
                    f"batch_dim {batch_dim} is not a dimension of the model's first input "
                    f"(shape {list(self._first_input) if self._first_input is not None else None})"
                )
        return Summary(
            self.model_type,
            self._layers,
            self._first_input,
            batch_dim=batch_dim if batch_size is not None else self._batch_dim,
            scale_to=batch_size if batch_size is not None else self._scale_to,
            dtype=as_dtype(dtype) if dtype is not None else self.dtype,
        )

    def _resize(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` at the requested batch size (unchanged when no batch dimension matches)."""
        d, measured, wanted = self._batch_dim, self._measured_batch, self._scale_to
        if wanted is None or measured is None or len(shape) <= d or shape[d] != measured:
            return shape
        return shape[:d] + (wanted,) + shape[d + 1 :]

    def _bytes(self, numel: int, dtype: torch.dtype) -> int:
        size = self.dtype.itemsize if self.dtype is not None and dtype.is_floating_point else dtype.itemsize
        return numel * size

    @property
    def _macs_scale(self) -> float:
        if self._scale_to is None or self._measured_batch is None:
            return 1.0
        return self._scale_to / self._measured_batch

    # ------------------------------------------------------------------ access

    def __getitem__(self, name: str) -> LayerRow:
        try:
            return self._index[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._index), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"no module named {name!r} in this {self.model_type} summary{hint}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[LayerRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return (
            f"Summary({self.model_type}: {len(self.rows)} modules, {self.total_params:,} params, "
            f"{self.total_macs:,} MACs at batch {self.batch_size})"
        )

    def __str__(self) -> str:
        return self.to_text()

    # ------------------------------------------------------------------ exports

    def to_text(self) -> str:
        """An aligned table, one row per module indented by depth, then the totals."""
        header = ("Layer (type)", "Input shape", "Output shape", "Params", "MACs", "Output bytes", "Calls")
        lines = [header]
        for row in self.rows:
            label = f"{row.name.rpartition('.')[2]} ({row.type})" if row.name else self.model_type
            lines.append(
                (
                    "  " * row.depth + label,
                    _shapes_text(row.input_shapes),
                    _shapes_text(row.output_shapes),
                    f"{row.params:,}",
                    f"{row.macs:,}",
                    f"{row.activation_bytes:,}",
                    str(row.calls) if row.calls else "--",
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        rule = "=" * (sum(widths) + 2 * (len(widths) - 1))

        def render(line: tuple[str, ...]) -> str:
            cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1]), line[2].ljust(widths[2])]
            cells += [cell.rjust(width) for cell, width in zip(line[3:], widths[3:])]
            return "  ".join(cells).rstrip()

        dtype = f"at {_dtype_name(self.dtype)}" if self.dtype is not None else "as run"
        body = [rule, render(header), rule, *map(render, lines[1:]), rule]
        body += [
            f"Total params: {self.total_params:,} ({_human_bytes(self.param_bytes)} {dtype})",
            f"Learnable params: {self.learnable_params:,}",
            f"Frozen params: {self.frozen_params:,}",
            f"Forward MACs: {_human(self.total_macs)} (= {_human(self.total_flops)} FLOPs; backward adds about 2x)",
            f"Output bytes of the leaf modules: {_human_bytes(self.activation_bytes)} ({dtype})",
            f"Batch size: {self.batch_size if self.batch_size is not None else 'unknown'}",
        ]
        body += [f"Tied: {name} is {owner} (counted once)" for row in self.rows for name, owner in row.tied.items()]
        return "\n".join(body + [rule])

    def to_csv(self, path: Optional[Union[str, os.PathLike]] = None) -> Optional[str]:
        """Flat CSV, one line per row; shapes and ties as JSON. Returns the text when ``path`` is None."""
        columns = [f.name for f in dataclasses.fields(LayerRow)]
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            values = row.as_dict()
            for key in ("input_shapes", "output_shapes", "tied"):
                values[key] = json.dumps(values[key])
            writer.writerow(values)
        return _emit(out.getvalue(), path)

    def to_json(self, path: Optional[Union[str, os.PathLike]] = None) -> Optional[str]:
        """Hierarchical JSON: ``{name: {"info": {...}, "children": {...}}}``, keyed by each
        module's attribute name and, at the top, by the model's type. Uses orjson when installed."""
        nodes: dict[str, dict[str, Any]] = {}
        tree: dict[str, Any] = {}
        for row in self.rows:
            node = {"info": row.as_dict(), "children": {}}
            nodes[row.name] = node
            if not row.name:
                tree[self.model_type] = node
            else:
                nodes[parent(row.name)]["children"][row.name.rpartition(".")[2]] = node
        return _emit(_dump_json(tree), path)

    def to_dataframe(self) -> Any:
        """The rows as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("Summary.to_dataframe needs pandas: pip install pandas") from e
        return pd.DataFrame([row.as_dict() for row in self.rows])


def as_dtype(dtype: DTypeLike) -> torch.dtype:
    """``"fp16"``, ``"bfloat16"``, ``torch.int8``, ... as a ``torch.dtype`` (fp32, fp16, bf16, int8)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or the torch dtype), got {dtype!r}")


def add_parameters(model: nn.Module, layers: list[Layer],
                   flattened: Optional[Mapping[str, tuple[int, torch.dtype, bool]]] = None) -> None:
    """Give each parameter tensor to the first module that holds it; later holders list it as tied.

    ``flattened``: FSDP1's record of the parameters it flattened (``(numel, dtype,
    requires_grad)`` by clean name, :attr:`~layerwatch.distributed.sharding.Layout.flattened`). Such a
    parameter counts whole, where the module holds this rank's piece of it, or nothing at all
    (``use_orig_params=False``). A DeepSpeed ZeRO-3 parameter, an empty placeholder outside its
    module's forward, counts whole too (``ds_numel``).
    """
    flattened = flattened or {}
    by_name = {layer.name: layer for layer in layers}
    owner_of: dict[int, str] = {}
    held: set[str] = set()
    for layer in layers:
        layer.own_params, layer.tied = [], {}
    for qualified, p in model.named_parameters(remove_duplicate=False):
        if getattr(p, "_is_flat_param", False):  # FSDP1's, holding many parameters
            continue
        qualified = clean_name(qualified)
        held.add(qualified)
        layer = by_name.get(parent(qualified))
        if id(p) in owner_of:
            if layer is not None and owner_of[id(p)] != qualified:
                layer.tied[qualified] = owner_of[id(p)]
            continue
        owner_of[id(p)] = qualified
        if layer is not None:
            numel = flattened[qualified][0] if qualified in flattened else getattr(p, "ds_numel", p.numel())
            layer.own_params.append((numel, p.dtype, p.requires_grad))
    for qualified in [name for name in flattened if name not in held]:  # in a flat parameter only
        layer = by_name.get(parent(qualified))
        if layer is not None:
            layer.own_params.append(flattened[qualified])


def _rows(layers: list[Layer], resize: Any, nbytes: Any, macs_scale: float) -> list[LayerRow]:
    """Rows with children's parameters (and, for modules never called, MACs) summed in."""
    totals: dict[str, list[int]] = {}  # name -> [params, learnable, param bytes, flops]
    for layer in reversed(layers):  # named_modules is pre-order: children come after parents
        mine = totals.setdefault(layer.name, [0, 0, 0, 0])
        mine[0] += sum(n for n, _, _ in layer.own_params)
        mine[1] += sum(n for n, _, grad in layer.own_params if grad)
        mine[2] += sum(nbytes(n, dtype) for n, dtype, _ in layer.own_params)
        if layer.calls:
            mine[3] = layer.flops  # measured around the call, children included
        if layer.name:
            above = totals.setdefault(parent(layer.name), [0, 0, 0, 0])
            for i in range(4):
                above[i] += mine[i]
    rows = []
    for layer in layers:
        params, learnable, param_bytes, flops = totals[layer.name]
        flops = round(flops * macs_scale)
        rows.append(
            LayerRow(
                name=layer.name,
                type=layer.type,
                depth=layer.depth,
                input_shapes=[list(resize(shape)) for shape, _ in layer.inputs],
                output_shapes=[list(resize(shape)) for shape, _ in layer.outputs],
                params=params,
                learnable_params=learnable,
                frozen_params=params - learnable,
                param_bytes=param_bytes,
                activation_bytes=sum(nbytes(math.prod(resize(s)), dtype) for s, dtype in layer.all_outputs),
                macs=flops // 2,
                flops=flops,
                calls=layer.calls,
                tied=dict(layer.tied),
            )
        )
    return rows


def describe(tensor: torch.Tensor) -> TensorSpec:
    return tuple(int(n) for n in tensor.shape), tensor.dtype


def _shapes_text(shapes: list[list[int]]) -> str:
    return ", ".join(str(shape) for shape in shapes) if shapes else "--"


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dump_json(tree: dict[str, Any]) -> str:
    try:
        import orjson
    except ImportError:
        return json.dumps(tree, indent=2)
    return orjson.dumps(tree, option=orjson.OPT_INDENT_2).decode()


def _emit(text: str, path: Optional[Union[str, os.PathLike]]) -> Optional[str]:
    if path is None:
        return text
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return None
