"""TensorBoard event records, framed with a CRC32C computed in C.

An event file is a sequence of TFRecords: ``uint64 length``, ``uint32 masked_crc32c(length)``,
the serialized ``Event``, ``uint32 masked_crc32c(event)`` (little-endian). TensorBoard's own
writer computes the CRC in pure Python (about 0.08 ms per KiB, on its writer thread, holding
the GIL); ``google-crc32c`` (or ``crc32c``) does it in C, and :func:`append` puts the records
into a ``SummaryWriter``'s own event file, so they share the run with everything else it
writes. Without either package, :data:`AVAILABLE` is False and callers use the writer's
``add_event``.
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Callable, Optional, Sequence

_crc32c: Optional[Callable[[bytes], int]]
try:
    from google_crc32c import value as _crc32c
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from crc32c import crc32c as _crc32c
    except ImportError:
        _crc32c = None

AVAILABLE = _crc32c is not None

_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_WALL_TIME = struct.Struct("<Bd")  # Event.wall_time: field 1, fixed64


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC32C of ``data``."""
    x = _crc32c(data)
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(payload: bytes) -> bytes:
    """One TFRecord holding ``payload``."""
    header = _LENGTH.pack(len(payload))
    return header + _CRC.pack(masked_crc32c(header)) + payload + _CRC.pack(masked_crc32c(payload))


def event(wall_time: float, step: int, summary: bytes) -> bytes:
    """A serialized ``Event {wall_time = 1; step = 2; summary = 5}`` around a serialized ``Summary``."""
    return _WALL_TIME.pack(1 << 3 | 1, wall_time) + bytes([2 << 3]) + varint(step) + field(5, summary)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2): key, length, payload."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


@functools.lru_cache(maxsize=1 << 14)  # the same lengths come back for every tag and histogram
def varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def append(writer: Any, payloads: Sequence[bytes]) -> bool:
    """Append events to the current event file of a ``torch`` ``SummaryWriter``, after all it
    has queued. Returns False, writing nothing, when the writer's file cannot be reached this
    way (no C CRC32C, another writer class, a file system without appends).

    The writer's queue is drained under its own lock, which also holds back its other users
    for the moment the bytes take to land: records never interleave.
    """
    if not AVAILABLE:
        return False
    try:
        queue_writer = writer._get_file_writer().event_writer._async_writer
        file = queue_writer._writer._writer
        lock, queue = queue_writer._lock, queue_writer._byte_queue
        appends = file.fs_supports_append and file.write_started
    except AttributeError:
        return False
    if not appends:
        return False
    data = b"".join(frame(p) for p in payloads)
    with lock:
        if queue_writer._closed:
            raise OSError("the SummaryWriter is closed")
        queue.join()
        file.write(data)
    return True
