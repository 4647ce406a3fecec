"""bench/: the helpers every benchmark shares live once in `bench/common.py`, and no benchmark
imports another that imports it back (read from the sources, nothing is run); what those helpers
compute (percentiles, tables, step medians) and the recipes they read."""

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


def test_options_make_an_option_of_each_entry() -> None:
    import argparse

    from bench.common import options

    parser = options(argparse.ArgumentParser(), rounds=(2, "rounds"), clients=[1, 8], out=Path, tiny=False)
    args = parser.parse_args(["--clients", "4", "32", "--out", "x"])
    assert vars(args) == {"rounds": 2, "clients": [4, 32], "out": Path("x"), "tiny": False}


def test_percentiles_latency_arms_and_tables() -> None:
    from bench.common import alternate, latency, md_table, percentile

    assert (percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5), percentile([5.0, 1.0, 3.0], 0.99)) == (3.0, 5.0)
    assert latency([3.0, 1.0, 2.0]) == {"n": 3, "p50_ms": 2.0, "p99_ms": 3.0, "max_ms": 3.0}
    assert alternate({"a": lambda r: r, "b": lambda r: -r}, 2) == {"a": [0, 1], "b": [0, -1]}
    assert md_table(["a", "b"], [[1, 2.5]], align=" :") == "| a | b |\n|---|---:|\n| 1 | 2.5 |"


def test_step_figures_leave_the_first_step_out() -> None:
    from bench.common import later_median, samples_per_s, step_medians

    assert samples_per_s([{"samples": 8, "time/step_s": 2.0}, {"samples": 8, "time/step_s": 2.0}]) == 4.0
    assert later_median([{"t": 9.0}, {"t": 1.0}, {}, {"t": 3.0}], "t") == 1.0  # the missing one counts 0
    steps = [(9.0, 8.0), (1.0, 0.0), (3.0, 16.0), (2.0, 8.0)]  # the second trained nothing
    rows = [{"time/step_s": s, "update/sequences": n} for s, n in steps]
    assert step_medians(rows) == {"median_step_s": 2.0, "median_updated_step_s": 2.5, "updated_steps": 3}
