"""Device values brought to the host: the transfers of rows and the copies read once landed.

- :func:`to_host`: blocking, one transfer per device, for a sampled step's rows;
- :func:`to_host_nonblocking`: one tensor's copy started, nothing waiting for it (on a GPU a
  non-blocking copy into pinned memory, behind a CUDA event);
- :class:`Landings`: such copies read in the order they were started, each once it has landed
  (the NaN sentinel's checks, the spike taps' values);
- :func:`host_reads_free`: whether the host reads a device's values without waiting at all.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional, Sequence

import numpy as np
import torch


def host_reads_free(device: torch.device) -> bool:
    """Whether the host reads a value on ``device`` without waiting for it (the CPU): code that
    reads one where that is free, and masks instead elsewhere, asks this, so a test can take the
    accelerator's way on the CPU."""
    return device.type == "cpu"


def to_host(pieces: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Bring float64 device tensors to the host in one transfer per device, in order (blocking)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, piece in enumerate(pieces):
        by_device.setdefault(piece.device, []).append(i)
    out: list[np.ndarray] = [np.empty(0)] * len(pieces)
    for indices in by_device.values():
        flat = torch.cat([pieces[i].reshape(-1).to(torch.float64) for i in indices]).cpu().numpy()
        for i, part in zip(indices, np.split(flat, np.cumsum([pieces[i].numel() for i in indices])[:-1])):
            out[i] = part
    return out


def to_host_nonblocking(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A copy of ``t`` on the host, and the event that says it landed (None: landed already): on
    a GPU a non-blocking copy into pinned memory, nothing waiting for it."""
    if t.device.type != "cuda":  # the CPU's (or another device's, whose copy waits: none gets here today)
        return t.to("cpu", copy=True), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # on the current stream of the tensor's device
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))  # that stream, even off the current device
    return host, event


def has_landed(events: Sequence[Any], wait: bool = False) -> bool:
    """Whether the copies behind ``events`` (None: landed already) have landed, asked in order
    and no further than the first that has not; ``wait``: the host waits for each (a sync)."""
    for event in events:
        if event is not None:
            if wait:
                event.synchronize()
            elif not event.query():
                return False
    return True


class Landings:
    """Host copies read once they have landed, in the order they were started, a step's at a
    time: each entry is what its owner keeps of a step (a list whose first item is the step, its
    copies among the rest) and the events of its copies. Nothing waits on the device unless asked
    to (``wait``). The owners read :attr:`entries` as it is (an unsampled step's path makes no
    call it can spare)."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: deque[tuple[list, list[Any]]] = deque()  # ([step, ...what the owner keeps], its copies' events)

    def add(self, kept: list, events: Optional[list[Any]] = None) -> None:
        """A new entry, last: ``kept`` (``kept[0]``: its step) and its copies' ``events`` (more may be added to the list)."""
        self.entries.append((kept, [] if events is None else events))

    def landed(self, wait: bool = False, through: float = math.inf) -> list:
        """What each entry keeps whose copies have landed, oldest first, taken off: up to the first
        entry that has not landed or whose step is past ``through``. ``wait``: the host waits for
        each entry's copies (a device sync)."""
        out, entries = [], self.entries
        while entries:
            kept, events = entries[0]
            if kept[0] > through or not has_landed(events, wait):
                break
            entries.popleft()
            out.append(kept)
        return out

    def clear(self) -> None:
        self.entries.clear()
