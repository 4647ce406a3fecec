"""Doctests are collected by pytest from the source folders (`testpaths`, `--doctest-modules`,
the root conftest.py), so `make test` runs every one without a test naming its module; modules
without a doctest are not imported for it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_make_test_collects_the_source_folders_doctests() -> None:
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--doctest-modules" in pytest_ini["addopts"]
    assert {"shared", "cli", "services", "bench"} <= set(pytest_ini["testpaths"])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "shared/crucible_shared/jobs",
            "services/trainer/crucible_trainer/rl",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = out.stdout.split()
    assert "shared/crucible_shared/jobs/sections.py::crucible_shared.jobs.sections.RewardSpec.limits" in ids
    assert any(i.startswith("services/trainer/crucible_trainer/rl/rewards.py::") for i in ids)
    assert not any("rl/losses.py" in i or "jobs/train.py" in i for i in ids)  # no doctest, no item


class Item:
    def __init__(self, nodeid: str, slow: bool = False) -> None:
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str) -> object:
        return object() if name == "slow" and self.slow else None


def test_the_files_with_the_most_slow_tests_run_first_each_file_kept_together_in_order() -> None:
    # The root conftest.py by its path: `conftest` names another one under xdist.
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)

    items = [
        Item("tests/unit/test_a.py::one"),
        Item("tests/unit/test_a.py::two"),
        Item("tests/integration/test_b.py::one", slow=True),
        Item("tests/integration/test_b.py::two"),
        Item("tests/integration/test_c.py::one", slow=True),
        Item("tests/integration/test_c.py::two", slow=True),
        Item("shared/x.py::x.f"),
    ]
    root_conftest.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [
        "tests/integration/test_c.py::one",
        "tests/integration/test_c.py::two",
        "tests/integration/test_b.py::one",
        "tests/integration/test_b.py::two",
        "tests/unit/test_a.py::one",
        "tests/unit/test_a.py::two",
        "shared/x.py::x.f",
    ]
    # ... which `make test` keeps: xdist would otherwise reorder the files by their number of tests
    assert "--dist loadfile --no-loadscope-reorder" in (ROOT / "Makefile").read_text()
