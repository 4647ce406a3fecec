"""Tenants, probed as an attacker with an ordinary key would: one key's jobs and runs are its own,
no key can read another's, starve it, or make a service read a body before the key is checked.
Real gateway and sandbox processes; each test fails on the code before tenants."""

from __future__ import annotations

import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
from crucible_shared import keys
from redis import Redis

from tests.servers import spawn

KEY_A, KEY_B, KEY_ADMIN = "tenant-a-key-0123456789", "tenant-b-key-0123456789", "tenant-admin-key-012345"
TINY_EVAL = {"kind": "eval", "data": {"dataset": "mbpp", "ids": [11]}, "max_tokens": 16}
TENANTS = {
    "tenants": [
        {
            "name": "team-a",
            "keys": [KEY_A],
            "quotas": {"active_jobs": 3, "event_streams": 1, "spec_bytes": 4000},
        },
        {"name": "team-b", "keys": [KEY_B]},
        {"name": "ops", "keys": [KEY_ADMIN], "admin": True},
    ]
}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and body["error"]["status"] == r.status_code, r.text
    return body["error"]


@pytest.fixture
def gw(redis_url, stack_dirs):
    env = {
        "REDIS_URL": redis_url,
        "CRUCIBLE_GATEWAY_RUNS_DIR": str(stack_dirs["runs"]),
        "CRUCIBLE_GATEWAY_ADAPTER_DIR": str(stack_dirs["adapters"]),
        "CRUCIBLE_GATEWAY_TENANTS": json.dumps(TENANTS),
    }
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT") as service:
        yield service
        ids = Redis.from_url(redis_url).zrange(keys.jobs_index(), 0, -1)
        for job_id in ids:  # no queued job is left to a worker of another test, nor to a quota
            httpx.post(f"{service.url}/v1/jobs/{job_id.decode()}/cancel", headers=auth(KEY_ADMIN))


def submit(gw, key: str, spec: dict | None = None, **headers: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/jobs", json=spec or TINY_EVAL, headers={**auth(key), **headers})


def test_another_tenants_jobs_do_not_exist(gw, stack_dirs) -> None:
    job = submit(gw, KEY_A).json()["id"]
    run_dir = stack_dirs["runs"] / job
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.md").write_text("a's report")
    (stack_dirs["adapters"] / job / "v1").mkdir(parents=True, exist_ok=True)
    (stack_dirs["adapters"] / job / "v1" / "adapter_config.json").write_text("{}")
    for method, tail in (
        ("GET", ""),
        ("GET", "/events"),
        ("GET", "/artifacts"),
        ("GET", "/artifacts/report.md"),
        ("POST", "/cancel"),
        ("POST", "/retry"),
    ):
        r = httpx.request(method, f"{gw.url}/v1/jobs/{job}{tail}", headers=auth(KEY_B), timeout=10)
        assert r.status_code == 404 and error(r)["message"] == f"no job {job!r}", (tail, r.text)
    listed = httpx.get(f"{gw.url}/v1/jobs", headers=auth(KEY_B)).json()
    assert job not in [j["id"] for j in listed["jobs"]] and listed["total"] == 0
    kinds = httpx.get(f"{gw.url}/v1/jobs?kind=eval", headers=auth(KEY_B)).json()
    assert kinds["total"] == 0
    assert httpx.get(f"{gw.url}/v1/adapters", headers=auth(KEY_B)).json()["adapters"] == []
    # The owner and the admin see it.
    for key in (KEY_A, KEY_ADMIN):
        assert httpx.get(f"{gw.url}/v1/jobs/{job}", headers=auth(key)).json()["tenant"] == "team-a"
        assert (
            httpx.get(f"{gw.url}/v1/jobs/{job}/artifacts/report.md", headers=auth(key)).text == "a's report"
        )
        seen = [a["job_id"] for a in httpx.get(f"{gw.url}/v1/adapters", headers=auth(key)).json()["adapters"]]
        # The admin sees every adapter in the folder, those the worker's earlier test files left too.
        assert seen == [job] if key == KEY_A else job in seen
    assert job in [
        j["id"] for j in httpx.get(f"{gw.url}/v1/jobs?kind=eval", headers=auth(KEY_A)).json()["jobs"]
    ]


def test_idempotency_keys_are_per_tenant_and_bound_to_the_body(gw) -> None:
    a = submit(gw, KEY_A, **{"Idempotency-Key": "next-1"})
    b = submit(gw, KEY_B, {**TINY_EVAL, "name": "b's"}, **{"Idempotency-Key": "next-1"})
    assert a.status_code == b.status_code == 202 and a.json()["id"] != b.json()["id"]
    again = submit(gw, KEY_A, **{"Idempotency-Key": "next-1"})
    assert again.status_code == 200 and again.json()["id"] == a.json()["id"]
    other = submit(gw, KEY_A, {**TINY_EVAL, "name": "changed"}, **{"Idempotency-Key": "next-1"})
    assert other.status_code == 409 and error(other)["field"] == "Idempotency-Key"


def test_quotas_are_429_naming_the_quota(gw) -> None:
    big = {
        **TINY_EVAL,
        "data": {"dataset": "mbpp", "ids": [f"MBPP/{i}" for i in range(11, 511)]},
    }  # the test split
    r = submit(gw, KEY_A, big)
    assert r.status_code == 429 and "spec_bytes" in error(r)["message"] and r.headers["retry-after"]
    ids = [submit(gw, KEY_A).json()["id"] for _ in range(3)]
    r = submit(gw, KEY_A)
    assert r.status_code == 429 and "active_jobs" in error(r)["message"], r.text
    assert int(r.headers["retry-after"]) >= 1
    assert submit(gw, KEY_B).status_code == 202  # another tenant is not held by a's quota
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'crucible_gateway_tenant_rejected_total{quota="active_jobs",tenant="team-a"} 1.0' in metrics
    assert 'crucible_gateway_tenant_jobs_submitted_total{kind="eval",tenant="team-b"}' in metrics
    httpx.post(f"{gw.url}/v1/jobs/{ids[0]}/cancel", headers=auth(KEY_A))
    assert submit(gw, KEY_A).status_code == 202
    # One event stream for team-a: a second is refused while the first is open.
    with httpx.stream("GET", f"{gw.url}/v1/jobs/{ids[1]}/events", headers=auth(KEY_A), timeout=10) as first:
        assert first.status_code == 200
        r = httpx.get(f"{gw.url}/v1/jobs/{ids[2]}/events", headers=auth(KEY_A), timeout=10)
        assert r.status_code == 429 and "event_streams" in error(r)["message"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the closed stream is given back
        with httpx.stream(
            "GET", f"{gw.url}/v1/jobs/{ids[2]}/events", headers=auth(KEY_A), timeout=10
        ) as again:
            if again.status_code == 200:
                break
        time.sleep(0.2)
    else:
        raise AssertionError("a closed event stream still counts against the quota")


def _two_gateways(redis_url: str, stack_dirs, tenants: dict) -> list:
    """Two gateway apps (two replicas) on one Redis."""
    from crucible_gateway.api import create_app
    from crucible_gateway.settings import Settings

    settings = Settings(
        redis_url=redis_url,
        runs_dir=stack_dirs["runs"],
        adapter_dir=stack_dirs["adapters"],
        tenants=json.dumps(tenants),
    )
    return [create_app(settings) for _ in range(2)]


def test_quotas_hold_across_gateway_replicas(redis_url, stack_dirs) -> None:
    """A tenant sends its submissions and event streams to two replicas at once: it gets its quota,
    not twice it (per-process counts, or a check-then-create race, let every request in)."""
    import asyncio

    from crucible_shared.http import ApiError

    name = f"replicas-{uuid.uuid4().hex[:8]}"
    key = f"{name}-key-0123456789"
    tenants = {"tenants": [{"name": name, "keys": [key], "quotas": {"active_jobs": 3, "event_streams": 2}}]}
    apps = _two_gateways(redis_url, stack_dirs, tenants)
    tenant = apps[0].state.service.tenants.lookup(f"Bearer {key}")

    async def attack() -> None:
        clients = [
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", headers=auth(key))
            for app in apps
        ]
        ids: list[str] = []
        try:
            answers = await asyncio.gather(
                *(clients[i % 2].post("/v1/jobs", json=TINY_EVAL) for i in range(10))
            )
            ids = [r.json()["id"] for r in answers if r.status_code == 202]
            codes = sorted(r.status_code for r in answers)
            assert codes == [202] * 3 + [429] * 7, codes
            services = [app.state.service for app in apps]
            streams = [await services[0].open_stream(tenant), await services[1].open_stream(tenant)]
            for service in services:  # both replicas see the two streams the tenant holds
                with pytest.raises(ApiError) as refused:
                    await service.open_stream(tenant)
                assert refused.value.status == 429 and "event_streams" in refused.value.message
            await streams[0].release()  # a stream that ends gives its slot back to every replica
            streams[0] = await services[1].open_stream(tenant)
            for lease in streams:
                await lease.release()
        finally:
            for job in ids:
                await clients[0].post(f"/v1/jobs/{job}/cancel")
            for client in clients:
                await client.aclose()
            for app in apps:
                await app.state.service.store.close()

    asyncio.run(attack())


# -- sandbox ---------------------------------------------------------------------------------------
SANDBOX_TENANTS = {
    "tenants": [
        {"name": "flood", "keys": [KEY_A], "quotas": {"queued_runs": 40, "concurrent_runs": 2}},
        {"name": "quiet", "keys": [KEY_B], "quotas": {"queued_runs": 4, "worker_seconds_per_minute": 1.0}},
        {"name": "fair", "keys": [KEY_ADMIN]},
    ]
}
PASSING = {"code": "def f(): return 1", "tests": {"kind": "asserts", "asserts": ["assert f() == 1"]}}


@pytest.fixture(scope="module")
def sandbox_tenants():
    env = {"CRUCIBLE_SANDBOX_WORKERS": "2", "CRUCIBLE_SANDBOX_TENANTS": json.dumps(SANDBOX_TENANTS)}
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as svc:
        yield svc


def _raw(url: str, request: bytes) -> bytes:
    """Send `request` on a raw socket; whatever the server answers (up to 4 KiB)."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(request)
        return sock.recv(4096)


def test_the_key_is_checked_before_the_body_is_read(sandbox_tenants) -> None:
    # Declares 60 MiB, sends 10 bytes: the 401 comes back without the server waiting for the rest.
    started = time.monotonic()
    head = (
        b"POST /v1/runs/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 62914560\r\n\r\n{"runs": ['
    )
    answer = _raw(sandbox_tenants.url, head)
    assert answer.startswith(b"HTTP/1.1 401") and time.monotonic() - started < 5, answer[:200]
    # Malformed JSON without a key is a 401, not a 422; and so is any path, present or future.
    for path in ("/v1/runs", "/v1/runs/batch", "/run_code", "/v1/anything"):
        r = httpx.post(
            f"{sandbox_tenants.url}{path}", content=b"{nope", headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 401, (path, r.text)
    assert httpx.get(f"{sandbox_tenants.url}/health").status_code == 200


def test_the_result_cache_is_per_tenant(sandbox_tenants) -> None:
    run = {
        "code": "print('a-private-output')\ndef f(): return 1",
        "tests": PASSING["tests"],
        "use_cache": True,
    }
    first = httpx.post(f"{sandbox_tenants.url}/v1/runs", json=run, headers=auth(KEY_A), timeout=60).json()
    again = httpx.post(f"{sandbox_tenants.url}/v1/runs", json=run, headers=auth(KEY_A), timeout=60).json()
    assert not first.get("cached") and again["cached"] is True
    other = httpx.post(f"{sandbox_tenants.url}/v1/runs", json=run, headers=auth(KEY_B), timeout=60).json()
    assert other["cached"] is False


def test_the_compile_cache_is_per_tenant(sandbox_tenants) -> None:
    """Tenant B submits the program A compiled (the result cache bypassed): were the compile cache
    shared, B's compile would come back `cached` and ~0 ms, telling B that A compiled it."""
    code = f'// {uuid.uuid4()}\n#include <cstdio>\nint main() {{ puts("hi"); }}\n'
    run = {"language": "cpp", "code": code, "tests": {"kind": "run"}, "use_cache": False}
    url = f"{sandbox_tenants.url}/v1/runs"
    first, again = (httpx.post(url, json=run, headers=auth(KEY_A), timeout=120).json() for _ in range(2))
    assert first["status"] == "passed" and not first["compile"]["cached"], first
    assert again["compile"]["cached"] is True  # A's own compile is cached for A
    other = httpx.post(url, json=run, headers=auth(KEY_ADMIN), timeout=120).json()
    assert other["status"] == "passed" and other["compile"]["cached"] is False, other["compile"]
    assert other["compile"]["duration_ms"] > 0


def test_by_default_a_tenant_leaves_a_worker_to_the_others(sandbox_tenants) -> None:
    from crucible_sandbox.server.service import SandboxService
    from crucible_sandbox.server.settings import Settings
    from crucible_shared.tenants import Tenant

    service = SandboxService(Settings(workers=4))
    assert service.quota(Tenant(name="x"), "concurrent_runs") == 3
    assert SandboxService(Settings(workers=1)).quota(Tenant(name="x"), "concurrent_runs") == 1


def test_sandbox_quotas_are_429_naming_the_quota(sandbox_tenants) -> None:
    r = httpx.post(f"{sandbox_tenants.url}/v1/runs/batch", json={"runs": [PASSING] * 5}, headers=auth(KEY_B))
    assert (
        r.status_code == 429 and "queued_runs" in error(r)["message"] and int(r.headers["retry-after"]) >= 1
    )
    slow = {
        "code": "import time\ntime.sleep(1.2)\ndef f(): return 1",
        "tests": PASSING["tests"],
        "use_cache": False,
    }
    assert (
        httpx.post(f"{sandbox_tenants.url}/v1/runs", json=slow, headers=auth(KEY_B), timeout=60).status_code
        == 200
    )
    r = httpx.post(f"{sandbox_tenants.url}/v1/runs", json=PASSING, headers=auth(KEY_B), timeout=60)
    # What it counts is named: a run that sleeps uses no CPU, but holds a worker.
    assert r.status_code == 429 and "worker_seconds_per_minute" in error(r)["message"], r.text
    assert int(r.headers["retry-after"]) >= 1
    metrics = httpx.get(f"{sandbox_tenants.url}/metrics").text
    assert (
        'crucible_sandbox_tenant_rejected_total{quota="worker_seconds_per_minute",tenant="quiet"}' in metrics
    )
    assert 'crucible_sandbox_tenant_runs_total{status="passed",tenant="quiet"}' in metrics


@pytest.mark.slow
def test_one_tenants_backlog_delays_another_by_one_run_slot(sandbox_tenants) -> None:
    """`flood` may hold both workers (its concurrent_runs quota) and has 8 runs of 2 s in flight (an
    8 s backlog); `fair`'s trivial run waits for one slot to come free (≤ 2 s), not for the
    backlog (FIFO: ~7 s)."""
    sleeper = {
        "code": "import time\ntime.sleep(2)\ndef f(): return 1",
        "tests": PASSING["tests"],
        "use_cache": False,
    }
    url = f"{sandbox_tenants.url}/v1/runs"
    with ThreadPoolExecutor(12) as pool:
        flood = [
            pool.submit(httpx.post, url, json=sleeper, headers=auth(KEY_A), timeout=120) for _ in range(12)
        ]
        time.sleep(1.0)  # the flood is queued
        started = time.monotonic()
        r = httpx.post(url, json={**PASSING, "use_cache": False}, headers=auth(KEY_ADMIN), timeout=120)
        waited = time.monotonic() - started
        assert r.status_code == 200 and r.json()["status"] == "passed"
        assert all(f.result().status_code == 200 for f in flood)
    assert waited < 4.5, f"fair's run waited {waited:.1f} s behind flood's backlog"


def test_the_worker_seconds_quota_keeps_its_old_name(monkeypatch) -> None:
    from crucible_sandbox.server.service import SandboxService
    from crucible_sandbox.server.settings import Settings
    from crucible_shared.tenants import TenantTable

    for key in ("cpu_seconds_per_minute", "worker_seconds_per_minute"):
        doc = {"tenants": [{"name": "t", "keys": [KEY_A], "quotas": {key: 7}}]}
        (tenant,) = TenantTable.load([], inline=json.dumps(doc)).names.values()
        assert SandboxService(Settings(workers=2)).quota(tenant, "worker_seconds_per_minute") == 7
    for env in ("CPU", "WORKER"):
        monkeypatch.delenv("CRUCIBLE_SANDBOX_TENANT_CPU_SECONDS_PER_MINUTE", raising=False)
        monkeypatch.setenv(f"CRUCIBLE_SANDBOX_TENANT_{env}_SECONDS_PER_MINUTE", "9")
        assert Settings().tenant_worker_seconds_per_minute == 9
        monkeypatch.delenv(f"CRUCIBLE_SANDBOX_TENANT_{env}_SECONDS_PER_MINUTE")
    assert Settings(tenant_worker_seconds_per_minute=3).tenant_worker_seconds_per_minute == 3


def test_a_tenant_file_and_plain_keys_load_together(tmp_path) -> None:
    from crucible_shared.tenants import TenantTable, plain_key_tenant

    file = tmp_path / "tenants.json"
    file.write_text(json.dumps(TENANTS))
    table = TenantTable.load(["plain-key-0123456789abcdef", KEY_A], file)
    assert table.lookup(f"Bearer {KEY_A}").name == "team-a"  # the JSON names it: its tenant wins
    assert table.lookup("Bearer plain-key-0123456789abcdef").name == plain_key_tenant(
        "plain-key-0123456789abcdef"
    )
    assert table.lookup(f"Bearer {KEY_ADMIN}").admin
    with pytest.raises(ValueError, match="TENANTS_FILE"):
        file.write_text("{not json")
        TenantTable.load([], file, env="CRUCIBLE_GATEWAY")


def test_the_reaper_reads_ids_and_timestamps_not_specs(gw, redis_url) -> None:
    """A flood of queued jobs: the reaper reads no whole record (no spec is parsed) unless it
    moves a job on; `/health` stays fast meanwhile."""
    import asyncio

    import redis.asyncio
    from crucible_gateway.service import GatewayService
    from crucible_gateway.settings import Settings
    from crucible_gateway.store import JobStore
    from crucible_shared.lifecycle import JobKind

    ids = [submit(gw, KEY_B).json()["id"] for _ in range(20)]
    assert all(ids)

    async def reap_without_whole_records() -> list:
        store = JobStore(
            redis.asyncio.Redis.from_url(redis_url), Redis.from_url(redis_url), dict.fromkeys(JobKind, 60)
        )

        async def no_records(*_args, **_kwargs):
            raise AssertionError("the reaper read a whole job record")

        store.get = store.get_many = no_records  # type: ignore[method-assign]
        try:
            return await GatewayService(Settings(redis_url=redis_url), store).reap(now=time.time() + 3600)
        finally:
            await store.close()

    assert asyncio.run(reap_without_whole_records()) == []  # queued in RQ: nothing to move on
    took = []
    for _ in range(50):
        t = time.perf_counter()
        assert httpx.get(f"{gw.url}/health").status_code == 200
        took.append(time.perf_counter() - t)
    assert sorted(took)[-1] < 1.0
