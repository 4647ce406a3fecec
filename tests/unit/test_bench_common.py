"""bench/: the helpers every benchmark shares live once in `bench/common.py`, and no benchmark
imports another that imports it back (read from the sources, nothing is run)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
SHARED = (
    *("free_port", "percentile", "card", "recipes", "load_job", "spawn_generator", "later_median"),
    *("services", "gateway", "run_job", "step_rows", "step_medians", "samples_per_s"),
)


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(BENCH.glob("*.py"))}


def _imports(tree: ast.Module, names: set[str]) -> set[str]:
    """The bench modules `tree` imports anywhere (top level or inside functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("bench."):
                out.add(node.module.split(".")[1])
            elif node.module == "bench":
                out |= {a.name for a in node.names}
            elif node.module in names:  # `from generator import ...`, run beside it
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {
                a.name.removeprefix("bench.") for a in node.names if a.name.removeprefix("bench.") in names
            }
    return out & names


def test_no_import_cycle_between_benchmarks() -> None:
    modules = _modules()
    graph = {name: _imports(tree, set(modules)) - {name} for name, tree in modules.items()}

    def visit(name: str, path: list[str]) -> None:
        for nxt in graph[name]:
            assert nxt not in path, " -> ".join([*path, nxt])
            visit(nxt, [*path, nxt])

    for name in graph:
        visit(name, [name])


def test_shared_helpers_are_defined_once() -> None:
    for name, tree in _modules().items():
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        copied = defined & set(SHARED)
        assert name == "common" or not copied, (
            f"bench/{name}.py defines {sorted(copied)}: use bench/common.py"
        )


def test_no_function_is_copied_between_benchmarks() -> None:
    """The same function body (names and docstrings aside) in two modules is a copy: share it."""
    seen: dict[str, str] = {}
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(node.body) > 2:
                body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
                key = "".join(ast.dump(stmt) for stmt in body)
                assert seen.setdefault(key, f"{name}.{node.name}") == f"{name}.{node.name}", (
                    f"bench/{name}.py's {node.name} repeats {seen[key]}: move it to bench/common.py"
                )


def test_every_job_spec_and_recipe_under_recipes_is_valid() -> None:
    """A file under recipes/ is a job spec (`kind`) or a table of recipes (a spec plus overrides each)."""
    import sys

    import yaml

    sys.path.insert(0, str(BENCH.parent))
    from bench.common import load_job, recipes

    files = sorted((BENCH.parent / "recipes").glob("*.yaml"))
    specs = [p for p in files if "kind" in yaml.safe_load(p.read_text())]
    assert len(specs) >= 2 and len(files) > len(specs)
    for path in specs:
        assert load_job(path).kind == yaml.safe_load(path.read_text())["kind"]
    for path in set(files) - set(specs):
        for name, recipe in recipes(path).items():
            assert (
                recipe.get("about") and load_job(BENCH.parent / recipe["spec"], recipe["set"]).kind == "train"
            ), name
