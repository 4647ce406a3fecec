"""Fixtures that spawn real services (see tests/servers.py)."""

from __future__ import annotations

import pytest

from tests.servers import Service, spawn

SECRET = "crucible-test-secret-value-0123456789"


@pytest.fixture(scope="session")
def sandbox() -> Service:
    env = {"CRUCIBLE_SANDBOX_WORKERS": "2", "CRUCIBLE_SANDBOX_CANARY_SECRET": SECRET}
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as service:
        yield service
