"""Fixtures that spawn real services (see tests/servers.py): the sandbox here, the generator with
test adapters (generator_fixtures) and the job stack (stack_fixtures), registered below."""

from __future__ import annotations

import os

import pytest

from tests.integration.generator_fixtures import client, generator, lora_dirs, tokenizer  # noqa: F401
from tests.integration.stack_fixtures import (  # noqa: F401
    gateway,
    redis_url,
    stack_dirs,
    stack_generator,
    workers,
)
from tests.servers import Service, spawn

SECRET = "crucible-test-secret-value-0123456789"


def _uid_block() -> int:
    """Which of 200 blocks of 64 run uids this test process's sandboxes use: by pid, so that other
    test sessions on the machine differ, and under pytest-xdist one per worker of this session."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        return os.getpid() % 200
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    return (os.getppid() % (200 // count)) * count + int(worker[2:]) % count


# Run uids of this process's sandboxes: distinct from any other sandbox on the machine, so the
# isolation tests can tell this sandbox's processes from others'.
UID_BASE = 62000 + 64 * _uid_block()


@pytest.fixture(scope="session")
def sandbox() -> Service:
    env = {
        "CRUCIBLE_SANDBOX_WORKERS": "2",
        "CRUCIBLE_SANDBOX_CANARY_SECRET": SECRET,
        "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE),
    }
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as service:
        yield service
