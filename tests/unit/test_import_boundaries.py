"""House rules on who may import whom, checked two ways: every import statement in the source (lazy
ones inside functions included), and what importing every module of a package really loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "transformers", "peft", "trl", "accelerate", "vllm"}
PACKAGES = {
    "crucible_shared": ROOT / "shared" / "crucible_shared",
    "crucible_cli": ROOT / "cli" / "crucible_cli",
    "crucible_models": ROOT / "models" / "crucible_models",
    "crucible_gateway": ROOT / "services" / "gateway" / "crucible_gateway",
    "crucible_sandbox": ROOT / "services" / "sandbox" / "crucible_sandbox",
    "crucible_generator": ROOT / "services" / "generator" / "crucible_generator",
    "crucible_trainer": ROOT / "services" / "trainer" / "crucible_trainer",
}
SERVICES = {"crucible_gateway", "crucible_sandbox", "crucible_generator", "crucible_trainer"}

# package -> top-level modules it must never import, anywhere in its source.
FORBIDDEN = {
    "crucible_shared": HEAVY | SERVICES | {"crucible_models", "crucible_cli"},
    "crucible_gateway": HEAVY
    | {"crucible_trainer", "crucible_generator", "crucible_sandbox", "crucible_models"},
    "crucible_sandbox": HEAVY
    | {"crucible_trainer", "crucible_generator", "crucible_gateway", "crucible_models"},
    "crucible_trainer": {
        "crucible_generator",
        "crucible_sandbox",
        "crucible_gateway",
        "crucible_cli",
        "vllm",
    },
    "crucible_generator": {"crucible_trainer", "crucible_sandbox", "crucible_gateway", "crucible_cli"},
}


def imported(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Top-level names of the modules a file imports (absolute imports)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_import_statement(package: str) -> None:
    bad = {
        str(path.relative_to(ROOT)): sorted(imported(path) & FORBIDDEN[package])
        for path in PACKAGES[package].rglob("*.py")
    }
    assert not {k: v for k, v in bad.items() if v}


def test_the_cli_imports_nothing_heavy_when_it_loads() -> None:
    """Commands that need the trainer import it inside the command; the modules themselves don't."""
    bad = {
        str(path.relative_to(ROOT)): sorted(imported(path, top_level_only=True) & (HEAVY | SERVICES))
        for path in PACKAGES["crucible_cli"].rglob("*.py")
    }
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize(
    ("package", "banned"),
    [
        ("crucible_shared", HEAVY | SERVICES),
        ("crucible_cli", HEAVY | SERVICES),
        ("crucible_gateway", HEAVY | {"crucible_trainer", "crucible_generator"}),
        ("crucible_sandbox", HEAVY | {"crucible_trainer", "crucible_generator"}),
    ],
)
def test_importing_every_module_loads_nothing_banned(package: str, banned: set[str]) -> None:
    modules = sorted(
        ".".join(path.relative_to(PACKAGES[package].parent).with_suffix("").parts).removesuffix(".__init__")
        for path in PACKAGES[package].rglob("*.py")
        if path.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(banned)!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing {package} loaded {out.stdout.strip()}"
