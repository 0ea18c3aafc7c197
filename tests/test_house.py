"""The house's shape, read from the source with ``ast`` (``tests/house.py``): no import loop (imports under
``if TYPE_CHECKING:`` and inside functions counted), no private name imported across modules,
no class over 300 lines or function over 60, the folders docs/architecture.md draws, and no
test module importing another. Nothing is imported or run: the files are parsed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from house import PACKAGE, House, depth, loops

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LONGEST_CLASS = 300
LONGEST_FUNCTION = 60
ARGPARSE_TABLE = ("layerwatch.cli", "main")  # the CLI's argparse table: one line an option, read as a table

# The top of the package: the public face, the three doors, the ground floor of public types.
TOP = {"__init__", "__main__", "cli", "demo", "inspector", "lightning", "huggingface", "options", "schedule",
       "routing", "vocabulary"}
FOLDERS = {"engine", "measure", "faults", "probes", "stats", "health", "sinks", "distributed", "table", "reading",
           "tensorboard_plugin", "guards"}
# From the top down: each imports only what is below it (docs/architecture.md's table of folders). The
# public face and the doors (the rest of TOP) stand above them all.
LAYERS = ["tensorboard_plugin/", "reading/", "engine/", "sinks/", "faults/", "health/", "measure/", "options", "probes/",
          "table/", "distributed/", "stats/", "guards/", "schedule", "routing", "vocabulary"]


HOUSE = House(SRC)
MODULES = HOUSE.modules


def test_no_import_loop():
    found = loops(HOUSE.import_graph())
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
        assert not HOUSE.imported(PACKAGE, node), f"layerwatch/__init__.py imports at run time: {ast.unparse(node)}"


def test_no_private_name_is_imported_across_modules():
    private = []
    for name, tree in HOUSE.trees.items():
        for node in ast.walk(tree):
            for target, taken in HOUSE.imported(name, node):
                if taken.startswith("_") and not taken.startswith("__"):
                    private.append(f"{name} imports {taken} from {HOUSE.owner(target)}")
    assert not private


def test_no_class_over_300_lines():
    long = [f"{name}.{node.name}: {lines}" for lines, name, node in HOUSE.sizes()
            if isinstance(node, ast.ClassDef) and lines > LONGEST_CLASS]
    assert not long


def test_no_function_over_60_lines():
    long = [f"{name}.{node.name}: {lines}" for lines, name, node in HOUSE.sizes()
            if not isinstance(node, ast.ClassDef) and lines > LONGEST_FUNCTION and (name, node.name) != ARGPARSE_TABLE]
    assert not long


def test_each_folder_imports_only_the_folders_below_it():
    upward = sorted(f"{module} imports {other}" for module, others in HOUSE.import_graph().items() for other in others
                    if HOUSE.place(module) in LAYERS and HOUSE.place(other) != HOUSE.place(module) and other != PACKAGE  # its version only
                    and (HOUSE.place(other) not in LAYERS or LAYERS.index(HOUSE.place(other)) < LAYERS.index(HOUSE.place(module))))
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
