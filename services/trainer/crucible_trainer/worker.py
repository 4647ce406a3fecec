"""`python -m crucible_trainer.worker`: an RQ SimpleWorker serving the `eval` and `train` queues
(in that order: a waiting evaluation is taken before the next training job).

On SIGTERM (a container restart, a rolling update) a running training job stops at its next
step boundary, checkpoints and goes back to the queue, where the next worker resumes it; the
worker then exits. At its start the worker records how many ranks it can launch for one job
(`crucible_shared.keys.worker_ranks`) and which installable models it has (`worker_models`), which
the gateway checks specs against. A second SIGTERM stops at once (RQ's cold shutdown).
"""

from __future__ import annotations

import argparse
import json
import logging


def installable_models() -> dict[str, list[str]]:
    """The models `crucible models install` knows, split by whether this host has them."""
    import crucible_models as models

    names = sorted(models.INSTALLABLE_MODELS)
    installed = [n for n in names if models.installed_path(n) is not None]
    return {"installed": installed, "missing": [n for n in names if n not in installed]}


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

    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.retry import Retry
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    from crucible_trainer.runtime.channel import WORKER_STOPPING

    class Worker(SimpleWorker):
        def request_stop(self, signum, frame):  # type: ignore[no-untyped-def]
            WORKER_STOPPING.set()
            super().request_stop(signum, frame)

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

    from crucible_trainer.distributed.launch import available_ranks

    redis.hset(keys.worker_ranks(), worker.name, available_ranks(settings))
    redis.hset(keys.worker_models(), worker.name, json.dumps(installable_models()))
    try:
        worker.work(burst=args.burst, with_scheduler=False)
    finally:
        redis.hdel(keys.worker_ranks(), worker.name)
        redis.hdel(keys.worker_models(), worker.name)


if __name__ == "__main__":
    main()
