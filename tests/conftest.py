"""Fixtures every test directory shares: the tiny checkpoints of each model family (tests/families.py),
and memory given back after tests that ran jobs in-process."""

import os

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
