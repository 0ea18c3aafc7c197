"""The format of the data inlined in a shared file (``layerwatch report --html``): JSON whose
numeric arrays live in one binary pool, the whole gzip-compressed.

Read back by the tab's front end (``tensorboard_plugin/static/index.js``: ``unpackAnswers``
and ``revive``), and by :func:`unpack` here, each giving back the very JSON that was packed. After gzip's decompression the bytes are::

    uint32 little-endian n | n bytes: the skeleton, UTF-8 JSON | zero bytes up to a multiple of 8 | the pool

In the skeleton, a list of numbers (with the routes' ``"NaN"`` for a non-finite value and
``null`` for one not measured), or a list of equally long such lists, becomes a reference
into the pool: ``{"$": [dtype, offset, length]}`` or ``{"$": [dtype, offset, rows, columns]}``,
``dtype`` one of ``"f4"``, ``"f8"``, ``"i4"`` (little-endian; float32 only where every value
survives it exactly), ``offset`` in bytes from the pool's start. In a float array, NaN stands
for ``"NaN"`` and -inf for ``null``. :class:`Float32Rows` (a base64 text of float32 rows, as the
heatmap route writes its values) becomes ``{"$b64": [[dtype, offset, length], ...]}``: its rows,
each stored apart so that a row equal to a layer's series is stored once. Every array in the
pool is stored once, however often it appears, and starts at a multiple of 8 bytes.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

SHORTEST_PACKED = 8  # a shorter list stays JSON: its reference would be longer than it
_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class Float32Rows:
    """A base64 text of float32 values (little-endian, rows one after another), kept as its rows."""

    rows: np.ndarray  # float32 [rows, columns]


class _Pool:
    """The binary pool: each distinct array once, at a multiple of 8 bytes."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._offsets: dict[tuple[str, bytes], int] = {}

    def add(self, array: np.ndarray) -> int:
        data = array.tobytes()
        key = (array.dtype.str, data)
        offset = self._offsets.get(key)
        if offset is None:
            padding = -self._size % 8
            self._chunks.append(b"\0" * padding + data)
            offset = self._offsets[key] = self._size + padding
            self._size = offset + len(data)
        return offset

    def tobytes(self) -> bytes:
        return b"".join(self._chunks)


def pack(value: Any) -> bytes:
    """``value`` (JSON data, with :class:`Float32Rows` where a base64 text of floats stands) as
    the gzip-compressed skeleton and pool described above."""
    pool = _Pool()
    skeleton = json.dumps(_packed(value, pool), allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()
    padding = b"\0" * (-(4 + len(skeleton)) % 8)
    return gzip.compress(struct.pack("<I", len(skeleton)) + skeleton + padding + pool.tobytes(), compresslevel=9, mtime=0)


def unpack(packed: bytes) -> Any:
    """The JSON data :func:`pack` packed (a :class:`Float32Rows` as its base64 text)."""
    data = gzip.decompress(packed)
    (length,) = struct.unpack_from("<I", data)
    skeleton = json.loads(data[4 : 4 + length])
    pool = memoryview(data)[4 + length + (-(4 + length) % 8) :]
    return _unpacked(skeleton, pool)


def _unpacked(value: Any, pool: memoryview) -> Any:
    if isinstance(value, list):
        return [_unpacked(item, pool) for item in value]
    if not isinstance(value, dict):
        return value
    if "$" in value:
        dtype, offset, *shape = value["$"]
        array = np.frombuffer(pool, dtype="<" + dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
        return _json_numbers(array)
    if "$b64" in value:
        rows = [pool[offset : offset + length * 4] for _, offset, length in value["$b64"]]
        return base64.b64encode(b"".join(rows)).decode("ascii")
    return {key: _unpacked(item, pool) for key, item in value.items()}


def _json_numbers(array: np.ndarray) -> Any:
    if array.ndim == 2:
        return [_json_numbers(row) for row in array]
    if array.dtype.kind == "i":
        return array.tolist()
    return [None if v == -math.inf else "NaN" if math.isnan(v) else v for v in array.astype(np.float64).tolist()]


def _packed(value: Any, pool: _Pool) -> Any:
    if isinstance(value, dict):
        return {key: _packed(item, pool) for key, item in value.items()}
    if isinstance(value, Float32Rows):
        rows = np.ascontiguousarray(value.rows, dtype="<f4")
        return {"$b64": [["f4", pool.add(row), row.size] for row in rows]}
    if isinstance(value, list):
        array = _numeric_array(value)
        if array is not None:
            return {"$": [array.dtype.str[1:], pool.add(array), *array.shape]}
        return [_packed(item, pool) for item in value]
    return value


def _numeric_array(values: list[Any]) -> Optional[np.ndarray]:
    """``values`` as a 1-D or 2-D little-endian array that gives them back exactly, or None
    (too short, not all numbers, or rows of unequal length)."""
    if values and all(type(row) is list for row in values):
        width = len(values[0])
        if width == 0 or any(len(row) != width for row in values):
            return None
        flat = _numeric_vector([v for row in values for v in row])
        return None if flat is None else flat.reshape(len(values), width)
    return _numeric_vector(values)


def _numeric_vector(values: list[Any]) -> Optional[np.ndarray]:
    if len(values) < SHORTEST_PACKED:
        return None
    kinds = {type(v) for v in values}
    if not kinds & {int, float} or not kinds <= {int, float, str, type(None)}:
        return None
    if str in kinds and any(type(v) is str and v != "NaN" for v in values):
        return None
    if kinds == {int}:
        ints = np.asarray(values, dtype=np.int64)
        return ints.astype("<i4") if _INT32.min <= ints.min() and ints.max() <= _INT32.max else None
    if int in kinds and any(type(v) is int and abs(v) > 2**53 for v in values):
        return None  # a float64 would round it
    floats = np.asarray([-np.inf if v is None else np.nan if type(v) is str else v for v in values], dtype=np.float64)
    if np.count_nonzero(~np.isfinite(floats)) != sum(1 for v in values if v is None or type(v) is str):
        return None  # a non-finite number: JSON has no place for it
    narrow = floats.astype(np.float32)
    exact = np.array_equal(narrow.astype(np.float64), floats, equal_nan=True)
    return narrow.astype("<f4") if exact else floats.astype("<f8")
