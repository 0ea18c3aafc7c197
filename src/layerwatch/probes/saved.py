"""The bytes autograd saves for backward, counted per module while its forward runs."""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Optional

import torch
from torch import nn


class SavedBytes:
    """``saved_tensors_hooks`` around each outermost forward (:meth:`enter`, :meth:`exit`) that
    add every storage saved for backward, once each per outermost forward and parameters
    excluded, to the modules ``running`` then (their indices, in ``bytes``): the micro-batches
    of an accumulated step add up, as their ``fwd_ms`` do. A user's own hooks (an offload, say)
    still pack every saved tensor: then this only counts."""

    def __init__(self, parameters: Iterable[nn.Parameter], modules: int, running: Callable[[], Collection[int]]) -> None:
        self.bytes = [0] * modules
        self._parameters = {storage_key(p) for p in parameters}
        self._counted: set[int] = set()
        self._running = running
        self._context: Any = None
        self._versions = SavedVersions()

    def enter(self) -> None:
        """Opens an outermost forward: what it saves is counted afresh."""
        # A storage is known by its address, and only while one forward's graph holds it: once
        # that graph's backward has freed it, the next forward may be given the same address.
        self._counted.clear()
        outer = enclosing_saved_tensors_hooks()
        if outer is None:
            context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._versions.unpack)
        else:
            outer_pack, outer_unpack = outer
            context = torch.autograd.graph.saved_tensors_hooks(lambda t: outer_pack(self._count(t)), outer_unpack)
        context.__enter__()
        self._context = context

    def exit(self) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        # Returning ``t`` itself would make a reference cycle through its grad_fn that keeps
        # activations alive; a detached alias shares its storage and version counter, and
        # the version keeps autograd's check against in-place changes of saved tensors.
        alias = t.detach()
        self._versions.versions[id(alias)] = t._version
        return alias

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key = storage_key(t)
            if key in self._parameters or key in self._counted:
                return t
            modules = self._running()
            if modules:
                self._counted.add(key)
                nbytes = t.untyped_storage().nbytes()
                for index in modules:
                    self.bytes[index] += nbytes
        except Exception:  # a tensor without a storage (a subclass, meta): not counted
            pass
        return t


class SavedVersions:
    """The version each tensor saved for backward had when it was saved, by the id of the alias
    kept in its place (an int in a dict, not a tuple per saved tensor), for autograd's check
    against in-place changes. The graph holds this, not the probe."""

    __slots__ = ("versions",)

    def __init__(self) -> None:
        self.versions: dict[int, int] = {}

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        version = self.versions.get(id(t))
        if version is not None and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a {tuple(t.shape)} {t.dtype} tensor is at version {t._version}; expected version {version}"
            )
        return t


def enclosing_saved_tensors_hooks() -> Optional[tuple[Callable, Callable]]:
    """The (pack, unpack) hooks of the innermost ``saved_tensors_hooks`` context the forward runs
    in (``save_on_cpu``, say), or None. Torch has no public reader of them, and its private one
    came with torch 2.8 (taking no argument in some builds); without it the probe's own hooks
    stand in for the user's during a sampled forward."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(False)
    except TypeError:
        return top()


def storage_key(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts (without making the storage's Python object, which stays)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()

