"""The gateway against real Redis, real RQ workers and spawned services."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from crucible_shared.gateway_client import GatewayClient
from crucible_shared.lifecycle import JobStatus
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from tests.servers import free_port, spawn

TINY_TRAIN = {
    "kind": "train",
    "name": "tiny",
    "method": {"name": "grpo"},
    "data": {"dataset": "mbpp", "ids": [601, 602]},
    # A job's lifecycle, not what it learns (test_trainer's): two samples of 24 tokens a step, as
    # test_fencing's jobs, a few seconds on a CPU (eight of 48 took about 20).
    "rollout": {"group_size": 2, "max_tokens": 24},
    "reward": {"kind": "graded"},
    # Micro-batches of 2: the update's peak memory is about 2.5 MB per token of a micro-batch.
    "optim": {"lr": 5e-4, "steps": 2, "problems_per_step": 1, "micro_batch": 2},
    "eval": None,
    "checkpoint": {"every": 1},
    "publish": {"stale_check": False},  # tested in test_trainer; here a job's lifecycle is
    "logging": {"wandb_mode": "disabled"},
}
TINY_EVAL = {
    "kind": "eval",
    "name": "tiny-eval",
    "data": {"dataset": "mbpp", "ids": [11, 12]},
    "max_tokens": 64,
}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


# -- fast: validation, errors, durability ------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"kind": "train", "optim": {"lr": -1}}, "train.optim.lr"),
        ({"kind": "train", "rollout": {"group_size": 1}}, "train"),
        ({"kind": "nope"}, "body"),
        ({"kind": "eval", "n": 2, "ks": [3]}, "eval"),
        ({"kind": "train", "method": {"name": "ppo", "epochs": 0}}, "train.method.ppo.epochs"),
        (
            {"kind": "train", "method": {"name": "reinforce"}, "overlap": {"max_staleness": 1}},
            "train.overlap.max_staleness",
        ),
    ],
)
def test_invalid_specs_are_422_naming_the_field(gateway, body, field) -> None:
    r = httpx.post(f"{gateway.url}/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["status"] == 422 and error["field"].startswith(field) and error["message"]


def test_unknown_jobs_and_bad_queries(gateway) -> None:
    for method, path in (
        ("GET", "/v1/jobs/nope"),
        ("POST", "/v1/jobs/nope/cancel"),
        ("GET", "/v1/jobs/nope/events"),
        ("GET", "/v1/jobs/nope/artifacts"),
    ):
        r = httpx.request(method, f"{gateway.url}{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
    r = httpx.get(f"{gateway.url}/v1/jobs", params={"status": "sleeping"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "status"
    r = httpx.post(f"{gateway.url}/v1/jobs", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"


def test_queued_jobs_survive_a_gateway_restart(redis_url, stack_dirs) -> None:
    env = {"REDIS_URL": redis_url, "CRUCIBLE_GATEWAY_RUNS_DIR": str(stack_dirs["runs"])}
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT") as first:
        ids = [GatewayClient(first.url).submit({**TINY_EVAL, "name": f"restart-{i}"}).id for i in range(2)]
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT") as second:
        client = GatewayClient(second.url)
        for job_id in ids:
            assert client.job(job_id).status == JobStatus.queued
        listed = {j.id for j in client.jobs(status="queued").jobs}
        assert set(ids) <= listed
        queue = Queue("eval", connection=Redis.from_url(redis_url), serializer=JSONSerializer)
        assert set(ids) <= set(queue.job_ids)
        for job_id in ids:  # leave no work behind for the workers of other tests
            assert client.cancel(job_id).status == JobStatus.cancelled
        assert not set(ids) & set(queue.job_ids)


def test_idempotency_key_makes_retries_safe(gateway) -> None:
    client = GatewayClient(gateway.url)
    first = client.submit({**TINY_EVAL, "name": "idem"}, idempotency_key="key-123")
    again = client.submit({**TINY_EVAL, "name": "idem"}, idempotency_key="key-123")
    assert first.id == again.id
    # The same key with a different body is a conflict naming the header, never the first job.
    r = httpx.post(f"{gateway.url}/v1/jobs", json=TINY_EVAL, headers={"Idempotency-Key": "key-123"})
    assert r.status_code == 409 and r.json()["error"]["field"] == "Idempotency-Key", r.text
    assert first.id in r.json()["error"]["message"]
    client.cancel(first.id)


def test_redis_down_is_503(stack_dirs) -> None:
    env = {
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "CRUCIBLE_GATEWAY_RUNS_DIR": str(stack_dirs["runs"]),
    }
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT", ready_path="/openapi.json") as gw:
        r = httpx.post(f"{gw.url}/v1/jobs", json=TINY_EVAL)
        assert r.status_code == 503
        assert "Redis" in r.json()["error"]["message"] and "Traceback" not in r.text
        assert httpx.get(f"{gw.url}/health").status_code == 503


def test_api_keys(redis_url, stack_dirs) -> None:
    key = "gateway-test-key-0123456789"
    env = {
        "REDIS_URL": redis_url,
        "CRUCIBLE_GATEWAY_API_KEYS": key,
        "CRUCIBLE_GATEWAY_RUNS_DIR": str(stack_dirs["runs"]),
    }
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT") as gw:
        assert httpx.get(f"{gw.url}/v1/jobs").status_code == 401
        assert httpx.get(f"{gw.url}/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(f"{gw.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{gw.url}/health").status_code == 200


# -- slow: real jobs through workers ----------------------------------------------------------


@pytest.mark.slow
def test_eval_and_train_jobs_run_to_completion_over_sse(gateway, workers, stack_dirs) -> None:
    workers.start()
    client = GatewayClient(gateway.url, timeout=120)
    created = client.submit(TINY_EVAL)
    assert created.status == JobStatus.queued and created.location.endswith(created.id)
    events = list(client.events(created.id, timeout=900))
    assert events[-1][1] == "end" and events[-1][2]["status"] == "finished", events[-3:]
    files = {a.path for a in client.artifacts(created.id).artifacts}
    assert any(p.endswith(".json") for p in files) and any(p.endswith(".md") for p in files), files

    train = client.submit(TINY_TRAIN)
    seen = list(client.events(train.id, timeout=1200))
    kinds = [e[1] for e in seen]
    assert kinds.count("metrics") == 2 and "adapter_published" in kinds and kinds[-1] == "end"
    job = client.job(train.id)
    assert job.status == JobStatus.finished and job.step == 2 and job.policy_version == f"{train.id}-v2"
    assert job.metrics["reward_mean"] is not None
    # Resuming the stream after the second event gives only what came after it.
    later = list(client.events(train.id, last_event_id=seen[1][0], timeout=60))
    assert [e[0] for e in later[:-1]] == [e[0] for e in seen[2:-1]]
    files = {a.path for a in client.artifacts(train.id).artifacts}
    assert {"metrics.jsonl", "adapter/adapter_config.json", "summary.json"} <= files
    body = httpx.get(f"{gateway.url}/v1/jobs/{train.id}/artifacts/metrics.jsonl")
    assert body.status_code == 200 and body.text.count("\n") == 2
    assert httpx.get(f"{gateway.url}/v1/jobs/{train.id}/artifacts/../../etc/passwd").status_code == 404
    adapters = {a["name"] for a in httpx.get(f"{gateway.url}/v1/adapters").json()["adapters"]}
    assert {f"{train.id}-v1", f"{train.id}-v2"} <= adapters


@pytest.mark.slow
def test_cancel_a_running_job(gateway, workers) -> None:
    workers.start()
    client = GatewayClient(gateway.url)
    job_id = client.submit({**TINY_TRAIN, "optim": {**TINY_TRAIN["optim"], "steps": 100}}).id
    wait_for(lambda: client.job(job_id).status == JobStatus.running, 300, "the job to start")
    client.cancel(job_id)
    started = time.monotonic()
    wait_for(lambda: client.job(job_id).status == JobStatus.cancelled, 60, "the job to stop")
    assert time.monotonic() - started < 30
    assert httpx.post(f"{gateway.url}/v1/jobs/{job_id}/cancel").status_code == 409


@pytest.mark.slow
def test_killed_worker_fails_the_job_and_retry_resumes(gateway, workers, stack_dirs) -> None:
    worker = workers.start()
    client = GatewayClient(gateway.url)
    spec = {**TINY_TRAIN, "max_attempts": 1}  # killed after step 1's checkpoint, step 2 on retry
    job_id = client.submit(spec).id
    checkpoints = stack_dirs["runs"] / job_id / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step-*")), 900, "the first checkpoint")
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    failed = wait_for(
        lambda: (j := client.job(job_id)).status == JobStatus.failed and j, 120, "the job to be marked failed"
    )
    assert "stopped reporting" in failed.error and "retry" in failed.error
    workers.start()
    assert client.retry(job_id).attempts == 2
    events = list(client.events(job_id, timeout=1200))
    kinds = [e[1] for e in events]
    assert "resumed" in kinds and kinds[-1] == "end", kinds
    final = client.job(job_id)
    assert final.status == JobStatus.finished and final.step == 2


@pytest.mark.slow
def test_a_lost_worker_s_job_is_retried_automatically(gateway, workers, stack_dirs) -> None:
    """With attempts left, a job whose worker died goes back to the queue by itself and resumes
    from its checkpoint on the next worker."""
    worker = workers.start()
    client = GatewayClient(gateway.url)
    spec = {**TINY_TRAIN, "max_attempts": 2}  # killed after step 1's checkpoint, step 2 on the next worker
    job_id = client.submit(spec).id
    checkpoints = stack_dirs["runs"] / job_id / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step-*")), 900, "the first checkpoint")
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    requeued = wait_for(
        lambda: (j := client.job(job_id)).status == JobStatus.queued and j, 120, "the job to be requeued"
    )
    assert requeued.attempts == 2 and "retried automatically" in requeued.error
    workers.start()
    kinds = [e[1] for e in client.events(job_id, timeout=1200)]
    assert "requeued" in kinds and "resumed" in kinds and kinds[-1] == "end", kinds
    final = client.job(job_id)
    assert final.status == JobStatus.finished and final.step == 2 and final.attempts == 2


@pytest.mark.slow
def test_a_stopping_worker_hands_its_job_back_at_a_step_boundary(gateway, workers, stack_dirs) -> None:
    """SIGTERM (a container restart): the job checkpoints after its current step and goes back to
    the queue at once, not after the heartbeat timeout; the next worker resumes it."""
    worker = workers.start()
    client = GatewayClient(gateway.url)
    # Stopped during step 1 or 2 (the job finishes the step it is in): step 3 is always left.
    spec = {**TINY_TRAIN, "optim": {**TINY_TRAIN["optim"], "steps": 3}, "checkpoint": {"every": 100}}
    job_id = client.submit(spec).id
    metrics = stack_dirs["runs"] / job_id / "metrics.jsonl"
    wait_for(lambda: metrics.exists(), 900, "the first step")
    worker.send_signal(signal.SIGTERM)
    started = time.monotonic()
    released = wait_for(
        lambda: (j := client.job(job_id)).status == JobStatus.queued and j, 300, "the job to be handed back"
    )
    assert "worker stopped after step" in released.error and released.attempts == 1
    assert worker.wait(120) == 0  # the worker exits once the job is handed back
    # Checkpointed at the step it stopped after, although checkpoint.every is 100.
    assert any((stack_dirs["runs"] / job_id / "checkpoints").glob("step-*"))
    assert time.monotonic() - started < 240
    workers.start()
    kinds = [e[1] for e in client.events(job_id, timeout=1200)]
    assert "requeued" in kinds and "resumed" in kinds and kinds[-1] == "end", kinds
    final = client.job(job_id)
    assert final.status == JobStatus.finished and final.step == 3
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3], steps


def test_jobs_asking_for_more_ranks_than_any_worker_has_are_422(gateway, redis_url, tmp_path) -> None:
    """A live worker reports the ranks it can launch (here 2, on a queue no job uses); the gateway
    refuses 4 naming the field, accepts 2, and once the worker is gone accepts anything again
    (the worker that takes it checks). The same report names the installable models the worker
    lacks: a job naming one is refused with the command that installs it."""
    import subprocess
    import sys

    from crucible_shared import keys

    redis = Redis.from_url(redis_url)
    env = {**os.environ, "REDIS_URL": redis_url, "CRUCIBLE_TRAINER_MAX_RANKS": "2"}
    env["CRUCIBLE_CACHE_DIR"] = str(tmp_path / "cache")
    worker = subprocess.Popen(
        [sys.executable, "-m", "crucible_trainer.worker", "--queues", "nothing"], env=env
    )
    try:
        wait_for(lambda: redis.hlen(keys.worker_ranks()), 120, "the worker's ranks")
        body = {**TINY_TRAIN, "distributed": {"train_gpus": 4}}
        r = httpx.post(f"{gateway.url}/v1/jobs", json=body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == "train.distributed.train_gpus"
        assert "asks for 4 ranks and the largest trainer worker can launch 2" in error["message"]
        r = httpx.post(f"{gateway.url}/v1/jobs", json={**TINY_TRAIN, "distributed": {"train_gpus": 2}})
        assert r.status_code == 202, r.text
        httpx.post(f"{gateway.url}/v1/jobs/{r.json()['id']}/cancel")  # no work left for other tests
        # The worker's cache (an empty one) lacks the installable model: a job naming it is refused
        # with the install command, in any case of the name.
        wait_for(lambda: redis.hlen(keys.worker_models()), 60, "the worker's models")
        spec = {**TINY_TRAIN, "model": {**TINY_TRAIN.get("model", {}), "base": "Qwen2.5-Coder-1.5B-Instruct"}}
        r = httpx.post(f"{gateway.url}/v1/jobs", json=spec)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == "train.model.base"
        assert "run `crucible models install qwen2.5-coder-1.5b-instruct`" in error["message"]
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert not redis.hlen(keys.worker_ranks()) and not redis.hlen(keys.worker_models())
