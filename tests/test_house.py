"""The house's shape, read from the source with ``ast``: no import loop (imports under
``if TYPE_CHECKING:`` and inside functions counted), no private name imported across modules,
no class over 300 lines or function over 60, the folders docs/architecture.md draws, and no
test module importing another. Nothing is imported or run: the files are parsed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "layerwatch"
LONGEST_CLASS = 300
LONGEST_FUNCTION = 60
ARGPARSE_TABLE = ("layerwatch.cli", "main")  # the CLI's argparse table: one line an option, read as a table

# The top of the package: the public face, the three doors, the ground floor of public types.
TOP = {"__init__", "__main__", "cli", "demo", "inspector", "lightning", "huggingface", "options", "schedule",
       "vocabulary"}
FOLDERS = {"engine", "measure", "faults", "probes", "stats", "health", "sinks", "distributed", "table", "reading",
           "tensorboard_plugin", "guards"}
# From the top down: each imports only what is below it (docs/architecture.md's table of folders). The
# public face and the doors (the rest of TOP) stand above them all.
LAYERS = ["tensorboard_plugin/", "reading/", "engine/", "sinks/", "faults/", "health/", "measure/", "options", "probes/",
          "table/", "distributed/", "stats/", "guards/", "schedule", "vocabulary"]


def modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


MODULES = modules()


def imported(name: str, package: bool, node: ast.AST) -> list[tuple[str, str]]:
    """(module, name) pairs an import statement takes from this package; name is '' for ``import x``."""
    if isinstance(node, ast.Import):
        return [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = name.split(".") if package else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return []
    return [(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source, alias.name) for alias in node.names]


def owner(target: str) -> str:
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of this package's modules, as written: ``from layerwatch.probes import X``
    is an edge to the package's ``__init__``, ``from layerwatch.probes.result import X`` to that module."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, (path, package) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for target, _ in imported(name, package, node):
                graph[name].add(owner(target))
        graph[name].discard(name)
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def depth(graph: dict[str, set[str]]) -> int:
    """The longest chain of imports (the graph has no loop)."""
    memo: dict[str, int] = {}

    def longest(node: str) -> int:
        if node not in memo:
            memo[node] = 1 + max((longest(other) for other in graph[node]), default=0)
        return memo[node]

    return max(longest(node) for node in graph)


def test_no_import_loop():
    found = loops(import_graph())
    assert not found, f"import loops (TYPE_CHECKING and function-level imports counted): {found}"


def test_the_loop_finder_finds_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert loops(graph) == [["a", "b", "c"]]
    assert depth({"a": {"b"}, "b": {"c"}, "c": set()}) == 3


def test_import_layerwatch_loads_no_submodule():
    tree = ast.parse((SRC / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        assert not imported(PACKAGE, True, node), f"layerwatch/__init__.py imports at run time: {ast.unparse(node)}"


def test_no_private_name_is_imported_across_modules():
    private = []
    for name, (path, package) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for target, taken in imported(name, package, node):
                if taken.startswith("_") and not taken.startswith("__"):
                    private.append(f"{name} imports {taken} from {owner(target)}")
    assert not private


def sizes() -> list[tuple[int, str, str]]:
    found = []
    for name, (path, _) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((node.end_lineno - node.lineno + 1, name, node))
    return found


def test_no_class_over_300_lines():
    long = [f"{name}.{node.name}: {lines}" for lines, name, node in sizes()
            if isinstance(node, ast.ClassDef) and lines > LONGEST_CLASS]
    assert not long


def test_no_function_over_60_lines():
    long = [f"{name}.{node.name}: {lines}" for lines, name, node in sizes()
            if not isinstance(node, ast.ClassDef) and lines > LONGEST_FUNCTION and (name, node.name) != ARGPARSE_TABLE]
    assert not long


def place(module: str) -> str:
    """A module's folder (``engine/``), or its own name at the top of the package (``options``)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and MODULES[module][1]):
        return parts[1] + "/"
    return parts[1] if len(parts) == 2 else "__init__"


def test_each_folder_imports_only_the_folders_below_it():
    upward = sorted(f"{module} imports {other}" for module, others in import_graph().items() for other in others
                    if place(module) in LAYERS and place(other) != place(module) and other != PACKAGE  # its version only
                    and (place(other) not in LAYERS or LAYERS.index(place(other)) < LAYERS.index(place(module))))
    assert not upward


def test_the_folders_are_the_architecture():
    top = {path.stem for path in (SRC / PACKAGE).glob("*.py")}
    folders = {path.name for path in (SRC / PACKAGE).iterdir() if (path / "__init__.py").exists()}
    assert top == TOP
    assert folders == FOLDERS
    drawn = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"`{folder}/`" in drawn for folder in FOLDERS), "docs/architecture.md has a line for each folder"


@pytest.mark.parametrize("path", sorted((ROOT / "tests").rglob("*.py")), ids=lambda path: path.name)
def test_no_test_module_imports_another(path):
    tests = {other.stem for other in (ROOT / "tests").rglob("test_*.py")}
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not any(name.split(".")[-1] in tests for name in names), f"{path.name} imports a test module: {ast.unparse(node)}"
