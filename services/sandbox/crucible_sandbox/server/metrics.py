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
REJECTED = Counter("crucible_sandbox_rejected_total", "Requests refused with 429 (queue full or a quota).")

# By tenant (`crucible_shared.tenants`); tenant names, never keys.
TENANT_RUNS = Counter(
    "crucible_sandbox_tenant_runs_total", "Runs executed, by tenant and status.", ["tenant", "status"]
)
TENANT_WORKER_SECONDS = Counter(
    "crucible_sandbox_tenant_worker_seconds_total", "Seconds a worker spent on the tenant's runs.", ["tenant"]
)
TENANT_PENDING = Gauge(
    "crucible_sandbox_tenant_pending_runs", "Runs admitted and not finished, by tenant.", ["tenant"]
)
TENANT_REJECTED = Counter(
    "crucible_sandbox_tenant_rejected_total",
    "Requests refused with 429, by tenant and quota.",
    ["tenant", "quota"],
)
