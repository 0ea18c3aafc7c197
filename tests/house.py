"""The house's shape read from the source with ``ast`` (nothing is imported or run): its modules,
their import graph (imports under ``if TYPE_CHECKING:`` and inside functions counted), its loops
and depth, the size of every class and function, and each module's place (its folder, or its own
name at the top of the package). ``tests/test_house.py`` holds the rules over it; run as a script
it prints the house::

    python tests/house.py [--src SRC]     # SRC: the folder that holds layerwatch/ (default: src)
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

PACKAGE = "layerwatch"


class House:
    """The modules under ``src/layerwatch`` and what they import of each other."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.modules: dict[str, tuple[Path, bool]] = {}  # name -> (path, is a package's __init__)
        for path in (src / PACKAGE).rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            package = parts[-1] == "__init__"
            self.modules[".".join(parts[:-1] if package else parts)] = (path, package)
        self.trees = {name: ast.parse(path.read_text()) for name, (path, _) in self.modules.items()}

    def imported(self, name: str, node: ast.AST) -> list[tuple[str, str]]:
        """(module, name) pairs an import statement of module ``name`` takes from this package
        (name '' for ``import x``)."""
        if isinstance(node, ast.Import):
            return [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == PACKAGE]
        if not isinstance(node, ast.ImportFrom):
            return []
        if node.level:
            base = name.split(".") if self.modules[name][1] else name.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != PACKAGE:
            return []
        return [(f"{source}.{alias.name}" if f"{source}.{alias.name}" in self.modules else source, alias.name)
                for alias in node.names]

    def owner(self, target: str) -> str:
        """The module that defines ``target`` (a module, or a name in one)."""
        while target not in self.modules and "." in target:
            target = target.rsplit(".", 1)[0]
        return target

    def import_graph(self) -> dict[str, set[str]]:
        """Each module's imports of this package's modules, as written: ``from layerwatch.probes import X``
        is an edge to the package's ``__init__``, ``from layerwatch.probes.result import X`` to that module."""
        graph: dict[str, set[str]] = {name: set() for name in self.modules}
        for name, tree in self.trees.items():
            for node in ast.walk(tree):
                graph[name].update(self.owner(target) for target, _ in self.imported(name, node))
            graph[name].discard(name)
        return graph

    def sizes(self) -> list[tuple[int, str, ast.AST]]:
        """(lines, module, node) of every class and function."""
        return [(node.end_lineno - node.lineno + 1, name, node) for name, tree in self.trees.items()
                for node in ast.walk(tree) if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]

    def place(self, module: str) -> str:
        """A module's folder (``engine/``), or its own name at the top of the package (``options``)."""
        parts = module.split(".")
        if len(parts) > 2 or (len(parts) == 2 and self.modules[module][1]):
            return parts[1] + "/"
        return parts[1] if len(parts) == 2 else "__init__"


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's, iteratively)."""
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
    """The longest chain of imports, a loop's members counted once each."""
    memo: dict[str, int] = {}

    def longest(node: str, seen: frozenset[str]) -> int:
        if node in seen:
            return 0
        if node not in memo:
            memo[node] = 1 + max((longest(other, seen | {node}) for other in graph[node]), default=0)
        return memo[node]

    return max(longest(node, frozenset()) for node in graph)


def report(house: House) -> str:
    """The house in words: its places and what each imports, its loops, depth, largest classes and functions."""
    graph = house.import_graph()
    places: dict[str, Counter] = {}
    for module, others in graph.items():
        mine = places.setdefault(house.place(module), Counter())
        mine.update(house.place(other) for other in others if house.place(other) != house.place(module))
    lines = [f"{len(house.modules)} modules; {sum(1 for p in places if not p.endswith('/'))} at the top, "
             f"{sum(1 for p in places if p.endswith('/'))} folders; import depth {depth(graph)}; "
             f"loops {loops(graph) or 'none'}; between places {loops({p: set(c) for p, c in places.items()}) or 'none'}"]
    for place_, uses in sorted(places.items()):
        lines.append(f"  {place_:22} -> " + ", ".join(f"{other} {n}" for other, n in sorted(uses.items())))
    sizes = sorted(house.sizes(), key=lambda size: -size[0])
    classes = [f"{m.split('.', 1)[-1]}.{n.name} {size}" for size, m, n in sizes if isinstance(n, ast.ClassDef)]
    functions = [f"{m.split('.', 1)[-1]}.{n.name} {size}" for size, m, n in sizes if not isinstance(n, ast.ClassDef)]
    lines.append("largest classes: " + ", ".join(classes[:6]))
    lines.append("largest functions: " + ", ".join(functions[:6]))
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src")
    print(report(House(parser.parse_args().src)))
