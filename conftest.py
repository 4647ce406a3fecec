"""Doctests, collected by pytest (`--doctest-modules`, pyproject.toml) from the source folders listed
in `testpaths`: only the modules that hold one (`>>>`) are imported for it, so collecting the
packages costs no more than the few imports the tests make anyway. Test files and `conftest.py`
files are collected as usual.

And the order the files run in: `make test` hands whole files to two xdist workers in collection
order (`--dist loadfile --no-loadscope-reorder`), so the files with the most `slow` tests come
first and the many quick files last, to even out the workers' ends. xdist's own order (the files
with the most tests first) left the few long single-test files (a whole job, the README path) to
the end, where one worker ran them while the other had finished."""

from __future__ import annotations

from collections import Counter
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort on a per-file key: each file's tests stay together and in their order.
    slow = Counter(item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.nodeid.split("::")[0]])
