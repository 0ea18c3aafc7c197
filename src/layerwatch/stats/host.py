"""Device values brought to the host: the one home of every copy there.

- :func:`to_host`: blocking, one transfer per device, for a sampled step's rows;
- :func:`to_host_nonblocking`: one tensor's copy started, nothing waiting for it (on a GPU a
  non-blocking copy into pinned memory, behind a CUDA event);
- :class:`Landings`: such copies read in the order they were started, each once it has landed
  (the NaN sentinel's checks, the spike taps' values);
- :func:`host_reads_free`: whether the host reads a device's values without waiting at all.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Optional, Sequence

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
    if wait:
        for event in events:
            if event is not None:
                event.synchronize()
        return True
    return all(event is None or event.query() for event in events)


class Landings:
    """Host copies read once they have landed, in the order they were started: each entry is
    what its owner keeps (its copies among it) and the events of its copies. Nothing waits on
    the device unless asked to (``wait``)."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: deque[tuple[Any, list[Any]]] = deque()  # (what the owner keeps, its copies' events)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Any]:
        """What each entry not yet taken keeps, oldest first."""
        return (kept for kept, _ in self.entries)

    def add(self, kept: Any, events: Optional[list[Any]] = None) -> tuple[Any, list[Any]]:
        """A new entry, last: ``kept`` and its copies' ``events`` (more may be added to its list)."""
        entry = (kept, [] if events is None else events)
        self.entries.append(entry)
        return entry

    @property
    def last(self) -> tuple[Any, list[Any]]:
        return self.entries[-1]

    def landed(self, wait: bool = False, until: Optional[Callable[[Any], bool]] = None) -> Iterator[Any]:
        """What each entry keeps whose copies have landed, oldest first, taken off as it is given;
        it stops at the first entry that has not landed (or that ``until`` refuses, asked first).
        ``wait``: the host waits for each entry's copies (a device sync)."""
        entries = self.entries
        while entries:
            kept, events = entries[0]
            if until is not None and not until(kept):
                break
            if not has_landed(events, wait):
                break
            entries.popleft()
            yield kept

    def clear(self) -> None:
        self.entries.clear()
