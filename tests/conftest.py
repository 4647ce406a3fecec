"""Fixtures every test directory shares: the tiny checkpoints of each model family (tests/families.py)."""

import os

# Under pytest-xdist (`make test` runs two workers) two processes share the two cores: OpenMP
# threads that spin while they wait would take the other worker's core. Set before torch loads,
# and inherited by the services and workers the tests spawn.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tests.families import family_checkpoints  # noqa: F401
