"""The gateway against bad input, written as an attacker would: key-space confusion, odd artifact
paths, forged stream ids, huge or chunked bodies, unauthenticated probing, specs with absurd
values or paths outside the roots. Every answer is a 4xx envelope naming the field, never a 500,
and nothing outside the run dirs is read."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from crucible_shared import keys
from crucible_shared.gateway_client import GatewayClient
from crucible_shared.lifecycle import JobStatus
from redis import Redis

from tests.servers import spawn

TINY_EVAL = {"kind": "eval", "data": {"dataset": "mbpp", "ids": [11]}, "max_tokens": 16}
API_KEY = "hardening-test-key-0123456789"


def envelope(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    assert body["error"]["status"] == r.status_code and body["error"]["message"]
    return body["error"]


@pytest.fixture
def job(gateway, redis_url) -> str:
    """A queued job whose event stream exists (as the trainer's channel writes it)."""
    job_id = GatewayClient(gateway.url).submit(TINY_EVAL).id
    Redis.from_url(redis_url).xadd(keys.events(job_id), {"data": json.dumps({"type": "status"})})
    yield job_id
    GatewayClient(gateway.url).cancel(job_id)


# -- key spaces ----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [":events", ":cancel", ":events/events", "%3Aevents", ":x/artifacts"])
def test_ids_naming_other_keys_are_refused_not_500(gateway, job, suffix) -> None:
    for method, tail in (("GET", ""), ("POST", "/cancel"), ("POST", "/retry"), ("GET", "/artifacts")):
        r = httpx.request(method, f"{gateway.url}/v1/jobs/{job}{suffix}{tail}")
        assert 400 <= r.status_code < 500, (suffix, tail, r.status_code, r.text)
        envelope(r)


def test_job_ids_are_validated(gateway) -> None:
    for bad in ("a" * 200, "..", "-x", "x y"):
        r = httpx.get(f"{gateway.url}/v1/jobs/{bad}")
        assert r.status_code in (404, 422) and envelope(r), (bad, r.text)
    r = httpx.get(f"{gateway.url}/v1/jobs/{'b' * 200}")
    assert r.status_code == 422 and envelope(r)["field"] == "job_id"


# -- artifacts ------------------------------------------------------------------------------------


def test_artifact_paths_with_nul_or_links_reveal_nothing(gateway, job, stack_dirs, tmp_path) -> None:
    run_dir = stack_dirs["runs"] / job
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.md").write_text("ok")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret" * 1000)
    (run_dir / "link.txt").symlink_to(secret)
    (run_dir / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    listing = GatewayClient(gateway.url).artifacts(job).artifacts
    assert [a.path for a in listing] == ["report.md"], listing
    for path in ("link.txt", "linkdir/secret.txt", "report.md%00.png", "%00", "a%00/..%2Freport.md"):
        r = httpx.get(f"{gateway.url}/v1/jobs/{job}/artifacts/{path}")
        assert r.status_code == 404, (path, r.status_code, r.text[:200])
        assert "s3cret" not in r.text
    assert httpx.get(f"{gateway.url}/v1/jobs/{job}/artifacts/report.md").text == "ok"


def raw_get(url: str, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written: httpx and browsers would fold `..` and `//` before sending."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


# Each is an attack class on `GET /v1/jobs/{id}/artifacts/{path}`. The first two read /etc/passwd
# before the containment check existed (the old check joined the root to an absolute path on both
# sides of an equality, so it compared the path with itself).
ESCAPES = {
    "absolute": "/etc/passwd",
    "absolute, encoded": "%2Fetc%2Fpasswd",
    "absolute, double slash": "//etc//passwd",
    "dot-dot": "../../../../../../../../etc/passwd",
    "dot-dot, encoded": "..%2F..%2F..%2F..%2F..%2F..%2F..%2F..%2Fetc%2Fpasswd",
    "dot-dot, encoded dots": "%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "dot-dot, backslashes": "..%5C..%5C..%5C..%5C..%5C..%5C..%5C..%5Cetc%5Cpasswd",
    "dot-dot inside then out": "sub/../../../../../../../../../etc/passwd",
    "proc": "/proc/{pid}/environ",
    "proc, encoded": "%2Fproc%2F{pid}%2Fenviron",
    "proc, self": "/proc/self/environ",
    "NUL": "report.md%00",
    "NUL, absolute": "%2Fetc%2Fpasswd%00report.md",
}


def test_an_artifact_swapped_for_a_link_is_never_served(gateway, job, stack_dirs, tmp_path) -> None:
    """Bounded race: a thread flips report.md between a file and a link to a host file while the
    client downloads it; zero downloads may hold the host file (the old check-then-reopen served it
    hundreds of times in ~6,000 requests)."""
    run_dir = stack_dirs["runs"] / job
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET")
    target, regular, link, stop = run_dir / "report.md", run_dir / ".r", run_dir / ".l", threading.Event()

    def swap() -> None:
        while not stop.is_set():
            regular.write_text("ok")
            os.replace(regular, target)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(secret)
            os.replace(link, target)

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    leaks = served = 0
    deadline = time.monotonic() + 3.0
    try:
        with httpx.Client(base_url=gateway.url, timeout=10) as http:
            while time.monotonic() < deadline:
                r = http.get(f"/v1/jobs/{job}/artifacts/report.md")
                served += r.status_code == 200
                leaks += "HOST-SECRET" in r.text
    finally:
        stop.set()
        thread.join()
    assert leaks == 0 and served > 0, (leaks, served)


def test_a_run_dir_that_is_a_link_lists_and_serves_nothing(gateway, job, stack_dirs, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "id_rsa").write_text("PRIVATE")
    run_dir = stack_dirs["runs"] / job
    if run_dir.exists():
        run_dir.rmdir()
    run_dir.symlink_to(elsewhere, target_is_directory=True)
    try:
        assert GatewayClient(gateway.url).artifacts(job).artifacts == []
        r = httpx.get(f"{gateway.url}/v1/jobs/{job}/artifacts/id_rsa")
        assert r.status_code == 404 and "PRIVATE" not in r.text
    finally:
        run_dir.unlink()


@pytest.mark.parametrize("attack", sorted(ESCAPES))
def test_artifact_paths_never_leave_the_run_dir(gateway, job, stack_dirs, attack) -> None:
    run_dir = stack_dirs["runs"] / job
    (run_dir / "sub").mkdir(parents=True, exist_ok=True)
    (run_dir / "report.md").write_text("ok")
    path = ESCAPES[attack].format(pid=gateway.proc.pid)  # the gateway's own environment
    status, body = raw_get(gateway.url, f"/v1/jobs/{job}/artifacts/{path}")
    assert status == 404, (attack, status, body[:200])
    assert b"root:" not in body and b"PATH=" not in body
    assert set(json.loads(body)) == {"error"}


def test_links_fifos_and_secrets_next_to_the_run_dir_are_refused(gateway, job, stack_dirs, tmp_path) -> None:
    """Links to /proc, /etc and to a file of keys beside the run dir; a FIFO that would hang a
    reader; a directory. Same 404 for all, and the request never blocks."""
    run_dir = stack_dirs["runs"] / job
    (run_dir / "sub").mkdir(parents=True, exist_ok=True)
    keys_file = stack_dirs["runs"] / "api-keys.txt"
    keys_file.write_text("s3cret-key")
    (run_dir / "environ").symlink_to("/proc/self/environ")
    (run_dir / "proc").symlink_to("/proc", target_is_directory=True)
    (run_dir / "etc").symlink_to("/etc", target_is_directory=True)
    (run_dir / "sub" / "keys").symlink_to("../../api-keys.txt")
    os.mkfifo(run_dir / "pipe")
    for path in ("environ", "proc/self/environ", "etc/passwd", "sub/keys", "pipe", "sub", "sub/"):
        status, body = raw_get(gateway.url, f"/v1/jobs/{job}/artifacts/{path}")
        assert status == 404, (path, status, body[:200])
        assert b"s3cret" not in body and b"root:" not in body
    status, _ = raw_get(gateway.url, f"/v1/jobs/{job}/artifacts/../{job}/report.md")
    assert status == 404


# -- event streams --------------------------------------------------------------------------------


@pytest.mark.parametrize("last", ["nope", "0", "1-x", "$", ">", "-1-1", "99999999999999999999999-0"])
def test_a_forged_last_event_id_is_a_422_before_the_stream(gateway, job, last) -> None:
    r = httpx.get(f"{gateway.url}/v1/jobs/{job}/events", headers={"Last-Event-ID": last}, timeout=10)
    assert r.status_code == 422, (last, r.status_code, r.text[:200])
    assert envelope(r)["field"] == "Last-Event-ID"


@pytest.mark.slow
def test_open_event_streams_do_not_starve_other_requests(gateway) -> None:
    """128 idle streams (queued jobs: no events yet) held open while other calls are made."""
    import asyncio

    client = GatewayClient(gateway.url)
    ids = [client.submit({**TINY_EVAL, "name": f"stream-{i}"}).id for i in range(8)]

    async def main() -> list[float]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as http:
            streams = [
                asyncio.create_task(http.get(f"/v1/jobs/{ids[i % len(ids)]}/events", timeout=60))
                for i in range(128)
            ]
            await asyncio.sleep(3)  # let them all open
            took = []
            for _ in range(10):
                t = time.monotonic()
                r = await http.get("/v1/jobs", params={"limit": 5})
                took.append(time.monotonic() - t)
                assert r.status_code == 200
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return took

    took = asyncio.run(main())
    for job_id in ids:
        client.cancel(job_id)
    assert max(took) < 2.0, took


# -- bodies and authentication --------------------------------------------------------------------


def test_bodies_are_capped_declared_or_chunked(gateway) -> None:
    big = b'{"kind": "eval", "name": "' + b"x" * (3 * 1024 * 1024) + b'"}'
    r = httpx.post(f"{gateway.url}/v1/jobs", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and envelope(r)["field"] == "body"

    def chunks():
        yield b'{"kind": "eval", "name": "'
        for _ in range(64):
            yield b"x" * (256 * 1024)
        yield b'"}'

    r = httpx.post(f"{gateway.url}/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and envelope(r)["field"] == "body"


def test_authentication_comes_before_validation(redis_url, stack_dirs) -> None:
    env = {
        "REDIS_URL": redis_url,
        "CRUCIBLE_GATEWAY_API_KEYS": API_KEY,
        "CRUCIBLE_GATEWAY_RUNS_DIR": str(stack_dirs["runs"]),
    }
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT") as gw:
        for body in (b"{", b'{"kind": "nope"}', b"x" * (2 * 1024 * 1024)):
            r = httpx.post(f"{gw.url}/v1/jobs", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 401, (body[:20], r.status_code, r.text[:200])
            assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/jobs/x:events", "/v1/jobs/nope/artifacts/%00", "/v1/adapters"):
            assert httpx.get(f"{gw.url}{path}").status_code == 401


# -- specs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"kind": "train", "model": {"lora_alpha": Infinity}}', "train.model.lora_alpha"),
        (b'{"kind": "train", "optim": {"lr": NaN}}', "train.optim.lr"),
        (b'{"kind": "eval", "temperature": -Infinity, "n": 2}', "eval.temperature"),
        (b'{"kind": "train", "optim": {"steps": 1000000000000}}', "train.optim.steps"),
        (b'{"kind": "train", "seed": 1180591620717411303424}', "train.seed"),
        (b'{"kind": "train", "data": {"dataset": "mbpp", "limit": 100000000000}}', "train.data.limit"),
        (b'{"kind": "train", "optim": {"problems_per_step": 10000000}}', "train.optim.problems_per_step"),
    ],
)
def test_absurd_numbers_are_refused(gateway, body: bytes, field: str) -> None:
    r = httpx.post(f"{gateway.url}/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert envelope(r)["field"].startswith(field), r.text


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"kind": "train", "data": {"dataset": "jsonl", "path": "/etc/shadow"}}, "train.data.path"),
        (
            {"kind": "train", "data": {"dataset": "stdio", "path": "../../../../etc/passwd"}},
            "train.data.path",
        ),
        ({"kind": "train", "model": {"base": "/etc"}}, "train.model.base"),
        ({"kind": "train", "model": {"base": "~/.ssh"}}, "train.model.base"),
        ({"kind": "train", "model": {"init_adapter": "/root"}}, "train.model.init_adapter"),
        ({"kind": "eval", "adapter": "/root"}, "eval.adapter"),
        (
            {"kind": "train", "eval": {"data": {"dataset": "jsonl", "path": "/proc/self/environ"}}},
            "train.eval.data.path",
        ),
    ],
)
def test_paths_outside_the_roots_are_refused(gateway, spec: dict, field: str) -> None:
    r = httpx.post(f"{gateway.url}/v1/jobs", json=spec)
    assert r.status_code == 422, r.text
    error = envelope(r)
    assert error["field"] == field and "outside" in error["message"], error


def test_fields_a_method_would_ignore_are_refused(gateway) -> None:
    for spec, field in (
        (
            {"kind": "train", "method": {"name": "srrl"}, "rollout": {"group_size": 4}},
            "train.rollout.group_size",
        ),
        ({"kind": "eval", "ks": [1, 5]}, "eval.ks"),
        (
            {"kind": "train", "method": {"name": "grpo", "clip_eps_high": 0.3}},
            "train.method.grpo.clip_eps_high",
        ),
        (
            {"kind": "train", "data": {"dataset": "humaneval", "challenge_tests": False}},
            "train.data.challenge_tests",
        ),
    ):
        r = httpx.post(f"{gateway.url}/v1/jobs", json=spec)
        assert r.status_code == 422 and envelope(r)["field"] == field, (spec, r.text)


# -- listing ----------------------------------------------------------------------------------------


def test_listing_by_status_follows_every_transition(gateway) -> None:
    client = GatewayClient(gateway.url)
    ids = [client.submit({**TINY_EVAL, "name": f"index-{i}"}).id for i in range(3)]
    client.cancel(ids[0])
    queued = {j.id for j in client.jobs(status="queued", limit=500).jobs}
    cancelled = {j.id for j in client.jobs(status="cancelled", limit=500).jobs}
    assert ids[0] in cancelled and ids[0] not in queued
    assert {ids[1], ids[2]} <= queued and not {ids[1], ids[2]} & cancelled
    assert all(j.status == JobStatus.queued for j in client.jobs(status="queued", limit=500).jobs)
    for job_id in ids[1:]:
        client.cancel(job_id)


def test_the_reaper_fails_a_silent_job_once(gateway, redis_url) -> None:
    """A running job whose heartbeat stopped is moved on by the reaper (reads never write)."""
    from crucible_shared.lifecycle import transition_command

    client = GatewayClient(gateway.url)
    job_id = client.submit({**TINY_EVAL, "max_attempts": 1}).id
    redis = Redis.from_url(redis_url)
    # Take it off the queue as a worker would, then go silent.
    from rq.job import Job
    from rq.serializers import JSONSerializer

    Job.fetch(job_id, connection=redis, serializer=JSONSerializer).cancel()
    stale = time.time() - 3600
    redis.eval(*transition_command(job_id, JobStatus.running, started_at=stale, heartbeat_at=stale))
    deadline = time.monotonic() + 30
    while (record := client.job(job_id)).status == JobStatus.running:
        assert time.monotonic() < deadline, "the reaper never moved the job on"
        time.sleep(0.3)
    assert record.status == JobStatus.failed and "stopped reporting" in record.error
    assert job_id in {j.id for j in client.jobs(status="failed", limit=500).jobs}


def test_worker_supervision_restarts_only_the_worker(tmp_path: Path) -> None:
    """`crucible up` starts a dead trainer worker again; any other service dying stops the stack."""
    import sys

    from crucible_cli.stack import Stack

    stack = Stack(state_dir=tmp_path)
    quick = [sys.executable, "-c", "import time; time.sleep(0.2)"]
    stack._start("worker", quick, "", {})
    stack._start("gateway", [sys.executable, "-c", "import time; time.sleep(4)"], "", {})
    messages: list[str] = []
    try:
        assert stack.supervise(report=messages.append, poll_s=0.1) == "gateway"
    finally:
        stack.stop()
    assert stack.worker_restarts >= 1 and "starting it again" in messages[0]
    assert os.path.exists(tmp_path / "logs" / "worker.log")
