"""The queue policy: an evaluation never waits behind a long job on the `train` queue.

`crucible up` starts the workers in `crucible_cli.stack.WORKERS`: one takes eval jobs before train
jobs, a second serves `eval` alone. Before, one worker served `train,eval` and an eval job
submitted behind `steps: 1000000` waited for it to finish. Here real workers, started with
those queues against real Redis and the gateway, run a pipeline job that holds its worker (it
waits for a generator that never answers) and an eval job submitted after it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from crucible_cli.stack import WORKERS
from crucible_shared.gateway_client import GatewayClient
from crucible_shared.lifecycle import FINAL, JobStatus
from redis import Redis

from tests.integration.stack_fixtures import WorkerFactory
from tests.servers import free_port


def test_every_worker_takes_evaluations_first_and_one_takes_nothing_else() -> None:
    assert all(queues.split(",")[0] == "eval" for queues in WORKERS.values()), WORKERS
    assert "eval" in WORKERS.values(), "no worker serves the eval queue alone"
    assert any("train" in queues.split(",") for queues in WORKERS.values())


@pytest.fixture
def stack_workers(redis_url, stack_dirs) -> Iterator[WorkerFactory]:
    Redis.from_url(redis_url).flushdb()  # jobs other tests left queued would take the workers
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: jobs wait for it until cancelled
    factory = WorkerFactory(
        {
            "REDIS_URL": redis_url,
            "CRUCIBLE_TRAINER_GENERATOR_URLS": dead,
            "CRUCIBLE_TRAINER_SANDBOX_URL": dead,
            "CRUCIBLE_TRAINER_ADAPTER_DIR": str(stack_dirs["adapters"]),
            "CRUCIBLE_TRAINER_RUNS_DIR": str(stack_dirs["runs"]),
            "CRUCIBLE_TRAINER_HEARTBEAT_S": "1",
            "CRUCIBLE_TRAINER_CANCEL_POLL_S": "0.5",
            "WANDB_MODE": "disabled",
        }
    )
    for queues in WORKERS.values():
        factory.start(queues)
    yield factory
    factory.stop_all()


def wait_for(client: GatewayClient, job_id: str, status: set[JobStatus], timeout: float = 120) -> JobStatus:
    deadline = time.monotonic() + timeout
    while (now := client.job(job_id).status) not in status:
        assert time.monotonic() < deadline, f"{job_id} is still {now.value}, not {status}"
        time.sleep(0.3)
    return now


def test_an_eval_job_starts_while_a_long_train_job_holds_its_worker(gateway, stack_workers) -> None:
    client = GatewayClient(gateway.url)
    long = client.submit({"kind": "pipeline", "name": "holds-a-worker", "stages": ["baseline"]}).id
    try:
        wait_for(client, long, {JobStatus.running})
        short = client.submit(
            {"kind": "eval", "name": "must-not-wait", "data": {"dataset": "mbpp", "ids": [11]}}
        )
        try:
            wait_for(client, short.id, {JobStatus.running}, timeout=60)
            assert (
                client.job(long).status == JobStatus.running
            )  # the train queue's job still holds its worker
        finally:
            client.cancel(short.id)
    finally:
        client.cancel(long)
    for job_id in (long, short.id):
        assert wait_for(client, job_id, set(FINAL), timeout=60) == JobStatus.cancelled
