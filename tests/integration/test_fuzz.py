"""Fuzz the gateway's and the sandbox's OpenAPI with schemathesis: whatever arrives, no 5xx.

Both valid requests (from the schema) and invalid ones (schemathesis' negative mode) are sent
to every operation of the running services.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

FUZZ = settings(
    max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)


def fuzz(url: str) -> list[str]:
    """Send generated requests to every operation; return the ones answered with a 5xx."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    schema.config.update(base_url=url)
    failures: list[str] = []
    calls = [0]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert operations, "the schema has no operations"
    for operation in operations:
        if operation.path.endswith("/events"):
            continue  # an open-ended stream: covered by the gateway tests
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @FUZZ
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case) -> None:
                response = case.call(timeout=60)
                calls[0] += 1
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:300]}"
                    )

            try:
                check()
            except Unsatisfiable:
                pass  # nothing to make invalid (e.g. GET /health has no parameters)
    assert calls[0] >= 10 * len(operations), calls
    return failures


@pytest.mark.slow
def test_sandbox_never_answers_5xx(sandbox) -> None:
    assert fuzz(sandbox.url) == []


@pytest.mark.slow
def test_gateway_never_answers_5xx(gateway, redis_url) -> None:
    from redis import Redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    try:
        assert fuzz(gateway.url) == []
    finally:
        # The fuzzer submitted real (valid) jobs: drop them before any worker of a later test sees them.
        for name in ("train", "eval"):
            Queue(name, connection=Redis.from_url(redis_url), serializer=JSONSerializer).empty()
