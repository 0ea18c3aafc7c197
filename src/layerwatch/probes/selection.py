"""Which modules are probed, and under which names."""

from __future__ import annotations

import fnmatch
from typing import Any, Optional, Sequence, Union

from torch import nn

from layerwatch.distributed import is_wrapper, named_modules, walk
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
    """Whether ``model`` or a part of it runs under torch.compile (module hooks would not
    see inside the compiled graph, and adding them forces a recompile)."""
    return any([hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None for _, m in walk(model)])


def split_at_compiled(model: nn.Module, selected: Sequence[tuple[str, nn.Module]]
                      ) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]], list[str]]:
    """The ``selected`` modules of a model with compiled parts, as (outside, inside, regions):
    the modules whose hooks run eagerly, those that run inside compiled code (their hooks are
    traced), and the names of the compiled parts hooked from outside.

    A ``torch.compile(module)`` wrapper runs its hooks eagerly around the compiled call: it is
    hooked, under its module's name, in place of that module, whose hooks run eagerly or are
    traced depending on its class. ``module.compile()`` compiles the module's call, and Dynamo
    starts at its ``forward``: its own hooks run under the compiler as frames of their own,
    each compiled apart (graphs and breaks of ours): it is in none of the three. Where that
    ``forward`` is torch's own (an ``nn.Sequential``), Dynamo starts nowhere there but at the
    user code below, and a hook on a module makes its ``forward`` a compiled frame of its own:
    no module of it is hooked."""
    inside_ids: set[int] = set()
    wrappers: dict[int, nn.Module] = {}  # id of a compiled module -> its torch.compile wrapper
    unhooked: set[int] = set()
    for module in model.modules():
        if is_wrapper(module) and hasattr(module, "_orig_mod"):
            compiled = module._orig_mod
            wrappers[id(compiled)] = module
            inside_ids.update(id(m) for m in compiled.modules() if m is not compiled)
        elif getattr(module, "_compiled_call_impl", None) is not None:
            unhooked.add(id(module))
            if starts_no_frame(module):  # nothing compiled at this level: a hook would make frames compile
                unhooked.update(id(m) for m in module.modules())
            else:
                inside_ids.update(id(m) for m in module.modules() if m is not module)
    outside, inside, regions = [], [], []
    for name, module in selected:
        if id(module) in unhooked:
            continue
        if id(module) in inside_ids:
            inside.append((name, module))
        elif id(module) in wrappers:
            outside.append((name, wrappers[id(module)]))
            regions.append(probe_name(name))
        else:
            outside.append((name, module))
    return outside, inside, regions


def starts_no_frame(module: nn.Module) -> bool:
    """Whether Dynamo, compiling ``module``'s call, skips its ``forward`` (torch's own code)."""
    try:
        from torch._dynamo import trace_rules

        return bool(trace_rules.check(module.forward))
    except Exception:
        return False
