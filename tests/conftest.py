"""Fixtures every test directory shares: the tiny checkpoints of each model family (tests/families.py),
memory given back after tests that ran jobs in-process, and an opt-in log of each test's memory.

`CRUCIBLE_TEST_RSS_LOG=PATH` appends one JSON line per test to PATH: its id, the xdist worker that
ran it, the process's resident memory before and after the test (setup and teardown included) and
its peak during the test, in MiB, the test's seconds, and the CPU seconds the test took in this
process and in the processes it started (services, workers, commands: running or ended). `python -m tests.rss_report PATH` sums it up
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
    # The generators the tests start decode a few rows of a small model at a time: one torch thread
    # does it in the same wall time as two at about two thirds of the CPU (8 samples of 48 tokens of
    # SmolLM2: 5.9 CPU s on two threads, 3.8 on one), which the other worker's tests then have.
    # Only the generator's: an update does use a second core (docs/testing.md).
    os.environ.setdefault("CRUCIBLE_GENERATOR_THREADS", "1")

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


def _children_cpu_seconds() -> float:
    """CPU seconds of every process this one started, directly or not: those it has reaped, and
    those still running (with what they reaped). The difference over a test is what it cost
    there, a session's services included, whether they ended during the test or not."""
    times = os.times()
    total = times.children_user + times.children_system
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        # After the name: state, ppid, ... utime (14th field of the line), stime, cutime, cstime.
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(x) for x in fields[11:15])
    mine, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in mine]
        mine.update(children)
        frontier.extend(children)
    return total + sum(ticks[pid] for pid in mine) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With CRUCIBLE_TEST_RSS_LOG set: one line per test of this process's memory around it, to
    find the tests after which an xdist worker stays larger (what it grows by is what it keeps)."""
    path = os.environ.get("CRUCIBLE_TEST_RSS_LOG")
    if not path:
        yield
        return
    peak_reset = _reset_peak()
    before, started, cpu, children = resident_bytes(), time.monotonic(), os.times(), _children_cpu_seconds()
    yield
    after, peak = resident_bytes(), _peak_bytes() if peak_reset else None
    cpu_end, children_end = os.times(), _children_cpu_seconds()
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
        "children_cpu_s": round(children_end - children, 2),
    }
    with open(path, "a") as f:  # one write per line: workers appending at once do not interleave
        f.write(json.dumps(row) + "\n")


@pytest.fixture(autouse=True)
def _release_jobs_memory():
    """Tests that run jobs in this process (as `crucible train --local` does) leave the models in
    reference cycles, and an xdist worker runs a hundred test files: without this its memory grew
    to 9 GB over the default run. `runtime.entry.execute` does the same for the trainer worker."""
    yield
    if resident_bytes() < RELEASE_ABOVE:
        return
    try:
        from crucible_trainer.runtime.hardware import release_memory
    except ImportError:  # a slim install without the trainer holds no job's memory
        return
    release_memory()
