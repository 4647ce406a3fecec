"""Fixtures that spawn real services (see tests/servers.py)."""

from __future__ import annotations

import os

import pytest

from tests.servers import Service, spawn

SECRET = "crucible-test-secret-value-0123456789"
# Run uids of this session's sandbox: distinct from any other sandbox on the machine, so the
# isolation tests can tell this sandbox's processes from others'.
UID_BASE = 62000 + 64 * (os.getpid() % 200)


@pytest.fixture(scope="session")
def sandbox() -> Service:
    env = {
        "CRUCIBLE_SANDBOX_WORKERS": "2",
        "CRUCIBLE_SANDBOX_CANARY_SECRET": SECRET,
        "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE),
    }
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as service:
        yield service
