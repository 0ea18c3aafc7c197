"""Which modules are probed, and under which names."""

from __future__ import annotations

import fnmatch
from typing import Any, Optional, Sequence, Union

from torch import nn

from layerwatch.distributed.sharding import named_modules, walk
from layerwatch.vocabulary import ROOT


ModuleFilter = Sequence[Union[str, type]]


def probe_name(name: str) -> str:
    return name or ROOT


def probe_names(modules: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """:func:`probe_name` of each module's name (one call for a model's thousand modules)."""
    return [name or ROOT for name, _ in modules]


def select_modules(model: nn.Module, modules: Optional[ModuleFilter]) -> list[tuple[str, nn.Module]]:
    """The modules to probe: every one, or those whose name matches a glob pattern or
    whose type is one of the given types. A wrapper (FSDP1, activation checkpointing) is
    not one: the module it wraps is, under the wrapper's name."""
    named = named_modules(model)
    if modules is None:
        return named
    patterns = [m for m in modules if isinstance(m, str)]
    types = tuple(m for m in modules if isinstance(m, type))
    return [
        (name, module)
        for name, module in named
        if isinstance(module, types) or any(fnmatch.fnmatchcase(probe_name(name), p) for p in patterns)
    ]


def check_module_filter(modules: Any) -> Optional[tuple[Union[str, type], ...]]:
    """Validate the ``modules=`` option: None, or a collection of glob patterns and module types."""
    if modules is None:
        return None
    if isinstance(modules, (str, type)):
        modules = (modules,)
    chosen = tuple(modules)
    if not chosen:
        raise ValueError("modules must name at least one pattern or type (or be None for every module)")
    for item in chosen:
        if isinstance(item, type):
            if not issubclass(item, nn.Module):
                raise TypeError(f"modules: {item.__name__} is not an nn.Module subclass")
        elif not isinstance(item, str) or not item:
            raise TypeError(f"modules: each entry must be a name pattern or an nn.Module type, got {item!r}")
    return chosen


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a part of it runs under torch.compile (``torch.compile(module)``'s
    wrapper, or ``module.compile()``): module hooks there would be compiled into its graph."""
    return any([hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None for _, m in walk(model)])
