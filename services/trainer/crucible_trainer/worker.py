"""`python -m crucible_trainer.worker`: an RQ SimpleWorker serving the `eval` and `train` queues
(in that order: a waiting evaluation is taken before the next training job).

On SIGTERM (a container restart, a rolling update) a running training job stops at its next
step boundary, checkpoints and goes back to the queue, where the next worker resumes it; the
worker then exits. At its start the worker records how many ranks it can launch for one job
(`crucible_shared.keys.worker_ranks`) and which installable models it has (`worker_models`), and
every `served.REFRESH_S` which base models its generators serve (`worker_served`), which the gateway
checks specs against. Before it takes its first job it imports what jobs run (`runtime.warm`, on
hosts of 8 cores or more) and, where it can launch several ranks, starts a `torchrun` group of
them that takes its cold start and waits for the next job of that many ranks (standby ranks,
`distributed.standby`; `CRUCIBLE_TRAINER_STANDBY_RANKS`); after a job that took them it starts
the next, and it stops them when it exits. A second SIGTERM stops at once (RQ's cold shutdown).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from typing import Any


def installable_models() -> dict[str, list[str]]:
    """The models `crucible models install` knows, split by whether this host has them."""
    import crucible_models as models

    names = sorted(models.INSTALLABLE_MODELS)
    installed = [n for n in names if models.installed_path(n) is not None]
    return {"installed": installed, "missing": [n for n in names if n not in installed]}


def served_bases(urls: list[str]) -> list[dict[str, Any]] | None:
    """The base models the first generator that answers serves (None: none answers)."""
    import httpx
    from crucible_shared import served
    from crucible_shared.openai_protocol import ModelList

    for url in urls:
        try:
            response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=5)
            response.raise_for_status()
            listing = ModelList.model_validate(response.json())
        except (httpx.HTTPError, ValueError):
            continue
        return [{"id": card.id, "root": card.root} for card in served.base_cards(listing)]
    return None


def report_served(redis: Any, name: str, urls: list[str], stop: threading.Event) -> None:
    """Record what the generators serve now and every `served.REFRESH_S` (a generator started
    after the worker, or restarted with another model, is seen), stamped with Redis's clock."""
    from crucible_shared import keys, served
    from redis.exceptions import RedisError

    while True:
        models = served_bases(urls)
        try:
            seconds, micros = redis.time()
            report = {"at": seconds + micros / 1e6, "models": models}
            redis.hset(keys.worker_served(), name, json.dumps(report))
        except RedisError:
            pass  # an outage: the gateway stops trusting the last report once it is old
        if stop.wait(served.REFRESH_S):
            return


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Run a Crucible trainer worker (settings: CRUCIBLE_TRAINER_*, REDIS_URL)."
    )
    parser.add_argument(
        "--queues",
        default="eval,train",
        help="comma-separated queues, in priority order (eval first: evaluations are short and must not wait)",
    )
    parser.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    parser.add_argument("--name", help="worker name")
    args = parser.parse_args()

    from crucible_trainer.settings import Settings

    settings = Settings()
    if not settings.redis_url:
        raise SystemExit(
            "crucible worker: set REDIS_URL (e.g. redis://127.0.0.1:6379/0) so the worker can find its queues"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from crucible_trainer.runtime import warm

    # The first job's imports, done before the worker registers (it is live once it can take a
    # job fast), not beside a job: two threads importing one package's circular modules can each
    # see the other's half-initialised module.
    if warm.worth_it():
        warm.attempt()

    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.retry import Retry
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    from crucible_trainer.distributed import launch
    from crucible_trainer.runtime.channel import WORKER_STOPPING

    standby = launch.standby_size(settings)  # ranks kept waiting for the next job, 0: none

    class Worker(SimpleWorker):
        def request_stop(self, signum, frame):  # type: ignore[no-untyped-def]
            WORKER_STOPPING.set()
            super().request_stop(signum, frame)

        def execute_job(self, job, queue):  # type: ignore[no-untyped-def]
            try:
                super().execute_job(job, queue)
            finally:  # the next job's ranks, if this one took them (or they exited), whatever its end
                if standby and not WORKER_STOPPING.is_set():
                    launch.keep_standby(standby)

    # After a Redis restart every pooled connection is dead: the first command on one reconnects
    # and is sent again (no socket timeout: RQ's dequeue blocks on the socket for minutes).
    redis = Redis.from_url(
        settings.redis_url, retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    )
    queues = [
        Queue(q.strip(), connection=redis, serializer=JSONSerializer)
        for q in args.queues.split(",")
        if q.strip()
    ]
    worker = Worker(queues, connection=redis, serializer=JSONSerializer, name=args.name)
    # What this worker can run, for the gateway's check of `distributed.train_gpus` at submission.
    from crucible_shared import keys

    redis.hset(keys.worker_ranks(), worker.name, launch.available_ranks(settings))
    redis.hset(keys.worker_models(), worker.name, json.dumps(installable_models()))
    stop = threading.Event()
    reporter = threading.Thread(
        target=report_served,
        args=(redis, worker.name, settings.generator_urls, stop),
        name="served-models",
        daemon=True,
    )
    reporter.start()
    try:
        if standby:
            launch.keep_standby(standby)
        worker.work(burst=args.burst, with_scheduler=False)
    finally:
        launch.release_standby()
        stop.set()
        reporter.join(10)
        redis.hdel(keys.worker_ranks(), worker.name)
        redis.hdel(keys.worker_models(), worker.name)
        redis.hdel(keys.worker_served(), worker.name)


if __name__ == "__main__":
    main()
