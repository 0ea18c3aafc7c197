"""The layer table: what each module is, its shapes, parameters, bytes and MACs.

``summarize(model, *args, **kwargs)`` runs one forward and returns a :class:`Summary`.
:class:`StructureProbe` is the hook set behind it; the Inspector arms the same probe on
its first sampled step to build the table from the real batch, with no extra forward.

MACs come from ``torch.utils.flop_counter.FlopCounterMode`` (PyTorch's own per-operator
formulas: matmul, linear, convolution, attention), read at the entry and exit of every
module call, so a module's count includes its children's. FlopCounterMode counts two
FLOPs per multiply-accumulate: ``macs = flops // 2``.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import io
import json
import math
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from layerwatch.distributed import clean_name, named_modules
from layerwatch.hooks import detached, entered_by_its_own_hook, is_compiling, tensors_in

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

_Tensor = tuple[tuple[int, ...], torch.dtype]  # what the table keeps of a tensor: shape and dtype


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
class _Layer:
    """What the probe learns about one module; the rows are computed from these."""

    name: str
    type: str
    depth: int
    own_params: list[tuple[int, torch.dtype, bool]] = field(default_factory=list)  # (numel, dtype, requires_grad)
    tied: dict[str, str] = field(default_factory=dict)  # this module's name of a tied parameter -> its owner's
    calls: int = 0
    flops: int = 0
    inputs: list[_Tensor] = field(default_factory=list)  # of the first call
    outputs: list[_Tensor] = field(default_factory=list)  # of the first call
    all_outputs: list[_Tensor] = field(default_factory=list)  # of every call


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
        layers: list[_Layer],
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
        parents = {_parent(row.name) for row in self.rows if row.name}
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
                nodes[_parent(row.name)]["children"][row.name.rpartition(".")[2]] = node
        return _emit(_dump_json(tree), path)

    def to_dataframe(self) -> Any:
        """The rows as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("Summary.to_dataframe needs pandas: pip install pandas") from e
        return pd.DataFrame([row.as_dict() for row in self.rows])


def summarize(model: nn.Module, *args: Any, **kwargs: Any) -> Summary:
    """Run ``model(*args, **kwargs)`` once and return its per-module table.

    The forward runs under ``torch.no_grad()`` in the model's current train/eval mode.
    Every hook is removed afterwards, the train/eval flags and every buffer (BatchNorm
    statistics) are restored, and the global RNG state is left as it was. The fused fast
    path of ``nn.TransformerEncoderLayer``/``nn.MultiheadAttention`` is switched off for the
    call, so their sub-modules run and are counted as they are in training.

    Example:
        >>> from torch import nn
        >>> import torch
        >>> s = summarize(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), torch.randn(2, 8))
        >>> s["0"].macs, s.total_params
        (64, 36)

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: The forward failed; the message names the module that was running.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = getattr(model, "_orig_mod", model)  # torch.compile: measure the eager module
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({t.device.index for t in (*model.parameters(), *model.buffers()) if t.is_cuda} - {None})
    probe = StructureProbe(model, training_only=False)
    fastpath = _mha_fastpath(False)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:
        where = f"{probe.failed_in!r}" if probe.failed_in else "the model"
        raise RuntimeError(f"summarize: the forward failed in {where}: {type(e).__name__}: {e}") from e
    finally:
        probe.remove()
        _mha_fastpath(fastpath)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for module, training in modes:
            module.training = training
    if probe.error is not None:
        raise RuntimeError(f"summarize: could not record the forward: {probe.error!r}")
    return probe.summary()


def as_dtype(dtype: DTypeLike) -> torch.dtype:
    """``"fp16"``, ``"bfloat16"``, ``torch.int8``, ... as a ``torch.dtype`` (fp32, fp16, bf16, int8)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or the torch dtype), got {dtype!r}")


class StructureProbe:
    """Hooks on every module that record calls, shapes and MACs; ``remove()`` is safe twice.

    A window opens when a module is entered with no module running and closes when it
    returns; FlopCounterMode is active only inside windows. With ``training_only``
    windows opened with autograd off (validation) are ignored. Calls during backward
    (activation checkpointing recomputes) are never counted. A hook that fails records
    the error and the probe goes quiet; it never raises into the forward.
    """

    def __init__(self, model: nn.Module, *, training_only: bool) -> None:
        self.model_type = type(getattr(model, "_orig_mod", model)).__name__  # torch.compile's wrapper: the model's
        self.training_only = training_only
        modules = named_modules(model)  # wrappers (FSDP1, checkpointing) left out, names clean
        self.layers = [_Layer(name, type(m).__name__, name.count(".") + 1 if name else 0) for name, m in modules]
        self._model = weakref.ref(model)
        self.error: Optional[BaseException] = None
        self.compiled = False  # a hook was traced by Dynamo (see probes.StepProbes)
        self.inert = False
        self.failed_in: Optional[str] = None
        self.windows = 0
        self.first_input: Optional[tuple[int, ...]] = None  # shape of the first tensor the model received
        self._stack: list[tuple[_Layer, int, Any]] = []  # (layer, FLOPs at entry, error being handled at entry)
        self._ignored_depth = 0
        self._counter: Any = None
        self._handles: list[Any] = []
        for layer, (_, module) in zip(self.layers, modules):
            self._handles.append(module.register_forward_pre_hook(self._enter_hook(layer), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit_hook(layer), with_kwargs=True, always_call=True))

    def summary(self) -> Summary:
        """The table of what was recorded, with the parameters as they are now."""
        model = self._model()
        if model is not None:
            _add_parameters(model, self.layers)
        return Summary(self.model_type, self.layers, self.first_input)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []
        self._ignored_depth = 0
        self._close_counter()

    # Hooks hold the layer record, never the module or the inspector.
    def _enter_hook(self, layer: _Layer) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if is_compiling():  # traced: note it (a store Dynamo replays), nothing else
                self.compiled = True
            elif self.error is None and not self.inert:
                try:
                    self._enter(layer, args, kwargs)
                except Exception as e:  # a probe must never break the forward
                    self._fail(e)

        return hook

    def _exit_hook(self, layer: _Layer) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not is_compiling() and self.error is None and not self.inert:
                try:
                    self._exit(layer, output)
                except Exception as e:
                    self._fail(e)

        return hook

    def _enter(self, layer: _Layer, args: tuple, kwargs: dict) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute inside backward
        if self._ignored_depth or (not self._stack and self.training_only and not torch.is_grad_enabled()):
            self._ignored_depth += 1  # a call outside training (validation): not recorded
            return
        if not self._stack:
            self._open_counter()
            if self.first_input is None:
                first = next(tensors_in((args, kwargs)), None)
                self.first_input = None if first is None else _describe(first)[0]
        if layer.calls == 0 and not self._running(layer):
            layer.inputs = [_describe(t) for t in tensors_in((args, kwargs))]
        self._stack.append((layer, self._counter.get_total_flops(), sys.exc_info()[1]))

    def _exit(self, layer: _Layer, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        if self._ignored_depth:
            self._ignored_depth -= 1
            return
        if not entered_by_its_own_hook(self._stack[-1][0] if self._stack else None, layer):
            return
        entered, flops_at_entry, error_at_entry = self._stack.pop()
        if entered is not layer:
            raise RuntimeError(f"module calls out of order: left {layer.name!r} while in {entered.name!r}")
        error = sys.exc_info()[1]
        if error is not None and error is not error_at_entry and self.failed_in is None:
            self.failed_in = layer.name or self.model_type  # the innermost module sees the error first
        outputs = [_describe(t) for t in tensors_in(output)]
        if layer.calls == 0:
            layer.outputs = outputs
        layer.all_outputs += outputs
        layer.calls += 1
        if not self._running(layer):  # a recursive call is counted in the outer one
            layer.flops += self._counter.get_total_flops() - flops_at_entry
        if not self._stack:
            self._close_counter()
            self.windows += 1

    def _running(self, layer: _Layer) -> bool:
        return any(entry[0] is layer for entry in self._stack)

    def _fail(self, error: Exception) -> None:
        self.error = detached(error)
        self._stack = []
        self._ignored_depth = 0
        self._close_counter()

    def _open_counter(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._counter = FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
        self._counter.__enter__()

    def _close_counter(self) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)


# ---------------------------------------------------------------------- helpers


def _add_parameters(model: nn.Module, layers: list[_Layer]) -> None:
    """Give each parameter tensor to the first module that holds it; later holders list it as tied."""
    by_name = {layer.name: layer for layer in layers}
    owner_of: dict[int, str] = {}
    for layer in layers:
        layer.own_params, layer.tied = [], {}
    for qualified, p in model.named_parameters(remove_duplicate=False):
        if getattr(p, "_is_flat_param", False):  # FSDP1's, holding many parameters
            continue
        qualified = clean_name(qualified)
        layer = by_name.get(_parent(qualified))
        if id(p) in owner_of:
            if layer is not None and owner_of[id(p)] != qualified:
                layer.tied[qualified] = owner_of[id(p)]
            continue
        owner_of[id(p)] = qualified
        if layer is not None:
            layer.own_params.append((p.numel(), p.dtype, p.requires_grad))


def _rows(layers: list[_Layer], resize: Any, nbytes: Any, macs_scale: float) -> list[LayerRow]:
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
            parent = totals.setdefault(_parent(layer.name), [0, 0, 0, 0])
            for i in range(4):
                parent[i] += mine[i]
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


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _describe(tensor: torch.Tensor) -> _Tensor:
    return tuple(int(n) for n in tensor.shape), tensor.dtype


def _extra_flop_formulas() -> dict[Any, Any]:
    """Formulas for two CPU kernels that PyTorch's registry leaves out (so they would count 0):
    flash attention, with PyTorch's own formula for it, and oneDNN's LSTM layer."""
    aten = torch.ops.aten
    extra: dict[Any, Any] = {}
    if hasattr(aten, "mkldnn_rnn_layer"):
        extra[aten.mkldnn_rnn_layer] = _rnn_layer_flops
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError:
        return extra
    formula = flop_registry.get(aten._scaled_dot_product_flash_attention)
    cpu_kernel = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if formula is not None and cpu_kernel is not None and cpu_kernel not in flop_registry:

        def cpu_flash_attention(*args: Any, **kwargs: Any) -> int:
            return formula(*args, **kwargs)

        cpu_flash_attention._get_raw = True  # type: ignore[attr-defined]  # the registry's formula takes tensors
        extra[cpu_kernel] = cpu_flash_attention
    return {op: f for op, f in extra.items() if op not in flop_registry}


def _rnn_layer_flops(inputs: torch.Tensor, weight_ih: torch.Tensor, weight_hh: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    """One direction of one recurrent layer: every time step of every sample multiplies its
    input by ``weight_ih`` and the hidden state by ``weight_hh``."""
    steps = inputs.numel() // inputs.shape[-1]
    return 2 * steps * (weight_ih.numel() + weight_hh.numel())


_rnn_layer_flops._get_raw = True  # type: ignore[attr-defined]


def _mha_fastpath(enabled: bool) -> bool:
    """Set the fused attention fast path; returns the previous setting."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        return enabled
    previous = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(enabled)
    return previous


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
