"""The sandbox's layout: subpackages by trust boundary importing one way, small modules, and the
typed messages between its processes naming the fields of the protocol models they mirror."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import crucible_sandbox
import pytest
from crucible_sandbox.isolation import confine, rootfs
from crucible_sandbox.server.service import SandboxService
from crucible_sandbox.server.settings import Settings
from crucible_sandbox.wire import messages
from crucible_shared import sandbox as protocol

PACKAGE = Path(crucible_sandbox.__file__).parent
# Each subpackage may import itself and those after it, never one before it.
ORDER = ["server", "judging", "isolation", "inrun", "wire"]


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _sandbox_imports(path: Path) -> set[str]:
    """The subpackages of the sandbox a module imports (top-level and lazy imports alike)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "crucible_sandbox" and len(parts) > 1 and parts[1] in ORDER:
                out.add(parts[1])
    return out


def test_every_module_lives_in_a_trust_boundary() -> None:
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "demo.py"}, "entry points only at the top"
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ORDER)


@pytest.mark.parametrize("package", ORDER)
def test_imports_point_one_way(package: str) -> None:
    allowed = set(ORDER[ORDER.index(package) :])
    bad = {
        str(path.relative_to(PACKAGE)): sorted(_sandbox_imports(path) - allowed)
        for path in (PACKAGE / package).rglob("*.py")
    }
    assert not {k: v for k, v in bad.items() if v}


def test_modules_and_functions_stay_small() -> None:
    long_modules, long_functions = [], []
    for path in _modules():
        text = path.read_text()
        if text.count("\n") > 600:
            long_modules.append(str(path.relative_to(PACKAGE)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > 100:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert not long_modules and not long_functions


def test_the_sandbox_masks_the_directory_it_is_imported_from() -> None:
    # A run's root covers the directory holding the package (when it lies in the trees a run
    # sees), whichever subpackage computes it.
    assert rootfs.package_home() == str(PACKAGE.parent)


def _keys(typed_dict: type) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)  # type: ignore[attr-defined]


def test_results_name_the_fields_of_the_protocol() -> None:
    assert _keys(messages.RunResultData) == set(protocol.RunResult.model_fields)
    # `memory` is the worker's own note, popped before a verdict leaves it.
    assert _keys(messages.TestVerdictData) - {"memory"} == set(protocol.TestVerdict.model_fields)


def test_capabilities_name_what_health_reports() -> None:
    reported = confine.Capabilities().report()
    assert set(reported) == _keys(messages.CapabilitiesData)
    assert set(reported) | {"mode", "warning"} == set(protocol.SandboxIsolation.model_fields)
    protocol.SandboxIsolation(mode="reduced", **reported)  # and validate as it


@pytest.mark.parametrize(
    ("tests", "typed"),
    [
        (protocol.AssertTests(asserts=["assert f() == 1"]), messages.AssertTests),
        (protocol.CheckTests(check="def check(c):\n    assert c()\n", entry_point="f"), messages.CheckTests),
        (protocol.StdioTests(cases=[protocol.StdioCase(output="1")]), messages.StdioTests),
        (protocol.RunOnly(call=protocol.Call(function="f")), messages.RunOnly),
    ],
)
def test_prepared_runs_have_the_typed_shape(tests, typed) -> None:
    prepared = SandboxService(Settings(workers=1)).prepare(protocol.RunRequest(code="x = 1", tests=tests))
    # A Python run has no `language` (its cache keys stay what they were), nor the limits of a
    # compile step or of runtimes that reserve address space; `cache_scope` (the tenant's part of
    # the compile cache) is added when the run goes to a worker, outside the result cache's key.
    assert set(prepared) == _keys(messages.PreparedRun) - {"language", "cache_scope"}
    assert set(prepared["tests"]) == _keys(typed)
    compiled = {"compile_time_s", "compile_memory_mb", "address_space_mb"}
    assert _keys(messages.RunLimits) - compiled == set(prepared["limits"])
    if typed is messages.StdioTests:
        run = protocol.RunRequest(language="bash", code="cat", tests=tests)
        prepared = SandboxService(Settings(workers=1)).prepare(run)
        assert prepared["language"] == "bash"
        assert _keys(messages.RunLimits) - {"address_space_mb"} == set(prepared["limits"])


def test_the_zygote_loads_no_message_types() -> None:
    # They are for the type checker: the zygote's heap, copied into every run, stays as small.
    code = "import sys, crucible_sandbox.isolation.zygote\nprint('crucible_sandbox.wire.messages' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
