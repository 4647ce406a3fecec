"""Doctests, collected by pytest (`--doctest-modules`, pyproject.toml) from the source folders listed
in `testpaths`: only the modules that hold one (`>>>`) are imported for it, so collecting the
packages costs no more than the few imports the tests make anyway. Test files and `conftest.py`
files are collected as usual."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.suffix != ".py" or not config.getoption("doctestmodules", False):
        return None
    name = collection_path.name
    if name == "conftest.py" or any(fnmatch(name, p) for p in config.getini("python_files")):
        return None  # tests: pytest decides as usual
    try:
        has_doctest = ">>>" in collection_path.read_text(errors="replace")
    except OSError:
        return None
    return None if has_doctest else True
