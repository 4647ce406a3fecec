"""Fixtures every test directory shares: the tiny checkpoints of each model family (tests/families.py),
memory given back after tests that ran jobs in-process, and an opt-in log of each test's memory.

`CRUCIBLE_TEST_RSS_LOG=PATH` appends one JSON line per test to PATH: its id, the xdist worker that
ran it, the process's resident memory before and after the test (setup and teardown included) and
its peak during the test, in MiB, the test's seconds, and the CPU seconds of the process and of the
child processes it reaped during the test. `python -m tests.rss_report PATH` sums it up
(docs/testing.md).
"""

import json
import os
import time

# Under pytest-xdist (`make test` runs two workers) two processes share the two cores: OpenMP
# threads that spin while they wait would take the other worker's core. Set before torch loads,
# and inherited by the services and workers the tests spawn.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from tests.families import family_checkpoints  # noqa: F401

RELEASE_ABOVE = 1 << 30  # resident bytes after a test beyond which the process gives memory back


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Start this process's peak resident memory (VmHWM) afresh (Linux 4.0+); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With CRUCIBLE_TEST_RSS_LOG set: one line per test of this process's memory around it, to
    find the tests after which an xdist worker stays larger (what it grows by is what it keeps)."""
    path = os.environ.get("CRUCIBLE_TEST_RSS_LOG")
    if not path:
        yield
        return
    peak_reset = _reset_peak()
    before, started, cpu = resident_bytes(), time.monotonic(), os.times()
    yield
    after, peak = resident_bytes(), _peak_bytes() if peak_reset else None
    cpu_end = os.times()
    mib = 1 << 20
    row = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "pid": os.getpid(),
        "rss_before_mb": round(before / mib, 1),
        "rss_after_mb": round(after / mib, 1),
        "peak_mb": None if peak is None else round(peak / mib, 1),
        "seconds": round(time.monotonic() - started, 2),
        # CPU time is what a loaded machine inflates least: compare runs by it.
        "cpu_s": round(cpu_end.user + cpu_end.system - cpu.user - cpu.system, 2),
        "children_cpu_s": round(
            cpu_end.children_user + cpu_end.children_system - cpu.children_user - cpu.children_system, 2
        ),
    }
    with open(path, "a") as f:  # one write per line: workers appending at once do not interleave
        f.write(json.dumps(row) + "\n")


@pytest.fixture(autouse=True)
def _release_jobs_memory():
    """Tests that run jobs in this process (as `crucible train --local` does) leave the models in
    reference cycles, and an xdist worker runs a hundred test files: without this its memory grew
    to 9 GB over the default run. `jobs.execute` does the same for the trainer worker."""
    yield
    if resident_bytes() < RELEASE_ABOVE:
        return
    try:
        from crucible_trainer.hardware import release_memory
    except ImportError:  # a slim install without the trainer holds no job's memory
        return
    release_memory()
