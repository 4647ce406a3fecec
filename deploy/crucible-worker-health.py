#!/opt/venv/bin/python
"""The trainer image's health check: exit 0 when Redis answers and an RQ worker started on this
host (same hostname) is registered. Installed as /usr/local/bin/crucible-worker-health."""

import socket
import sys

from crucible_trainer.settings import Settings
from redis import Redis
from rq import Worker
from rq.serializers import JSONSerializer

url = Settings().redis_url
if not url:
    sys.exit("REDIS_URL is not set")
redis = Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
redis.ping()
host = socket.gethostname()
workers = Worker.all(connection=redis, serializer=JSONSerializer)
if not any(w.hostname == host for w in workers):
    sys.exit(f"no RQ worker registered from {host}")
