"""Doctests are collected by pytest from the source folders (`testpaths`, `--doctest-modules`,
the root conftest.py), so `make test` runs every one without a test naming its module; modules
without a doctest are not imported for it."""

from __future__ import annotations

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
