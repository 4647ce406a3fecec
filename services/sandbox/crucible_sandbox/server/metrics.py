"""Prometheus metrics of the sandbox service."""

from prometheus_client import Counter, Gauge, Histogram

RUNS = Counter("crucible_sandbox_runs_total", "Runs executed, by overall status.", ["status"])
RUN_SECONDS = Histogram(
    "crucible_sandbox_run_seconds",
    "Time from a run getting a worker to its result.",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CACHE = Counter("crucible_sandbox_cache_total", "Result cache lookups.", ["result"])
QUEUE = Gauge("crucible_sandbox_pending_runs", "Runs admitted and not finished.")
WORKERS = Gauge("crucible_sandbox_workers", "Zygote worker slots.")
REJECTED = Counter("crucible_sandbox_rejected_total", "Requests refused with 429 because the queue was full.")
