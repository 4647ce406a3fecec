"""No import cycle anywhere: between the modules of Crucible's packages (imports inside functions
included, `if TYPE_CHECKING:` blocks excluded), read from the sources. The generator's modules
import one way even counting their `TYPE_CHECKING` imports: the engine holds its decode paths, and
the paths know it only through the interface they share (`decoding.Host`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    ROOT / "shared" / "crucible_shared",
    ROOT / "cli" / "crucible_cli",
    ROOT / "models" / "crucible_models",
    *sorted((ROOT / "services").glob("*/crucible_*")),
]


def modules() -> dict[str, Path]:
    out = {}
    for root in PACKAGES:
        for path in root.rglob("*.py"):
            parts = [root.name, *path.relative_to(root).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


class _Imports(ast.NodeVisitor):
    def __init__(self, known: set[str], package: str, type_checking: bool = False) -> None:
        self.known, self.package, self.found = known, package, set()
        self.type_checking = type_checking

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test) and not self.type_checking:  # not imported at run time
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found |= {a.name for a in node.names}

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: from the package this module is in
            parts = self.package.split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        for alias in node.names:
            name = f"{base}.{alias.name}"
            self.found.add(name if name in self.known else base)


def graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the modules it imports (`type_checking`: those imported for type hints only too)."""
    known = modules()
    edges = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        visitor = _Imports(set(known), package, type_checking)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        edges[name] = {m for m in visitor.found if m in known and m != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan).

    >>> cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules() -> None:
    edges = graph()
    assert len(edges) > 150 and sum(map(len, edges.values())) > 300  # the sources were read
    assert cycles(edges) == []


def test_the_generator_imports_one_way_even_for_type_hints() -> None:
    edges = {
        module: {m for m in imports if m.startswith("crucible_generator.")}
        for module, imports in graph(type_checking=True).items()
        if module.startswith("crucible_generator.")
    }
    assert "crucible_generator.sequences" in edges["crucible_generator.engine"]  # the parser sees them
    assert cycles(edges) == []
