"""Sandbox logic, independent of HTTP: validation, limits, cache, admission, batching.

Every run belongs to a tenant (`crucible_shared.tenants`): admission counts the tenant's queued
runs and its worker-seconds over the last minute against its quotas (429 naming the quota, with
Retry-After), a tenant's runs hold at most its `concurrent_runs` workers, the pool serves tenants
round robin, and a cached result answers only the tenant whose run filled it (or, for tenants that
opt in with `share_cache`, every other tenant that opted in).
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import os
import time
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from typing import Generic, TypeVar, cast

from crucible_shared.http import ApiError
from crucible_shared.sandbox import RunRequest, RunResult, RunStatus, SandboxIsolation
from crucible_shared.tenants import ANONYMOUS, Tenant

from crucible_sandbox.isolation import cgroups
from crucible_sandbox.judging import languages
from crucible_sandbox.judging.plan import plan_check
from crucible_sandbox.server import metrics
from crucible_sandbox.server.pool import WorkerPool
from crucible_sandbox.server.settings import Settings
from crucible_sandbox.wire.messages import PreparedRun, RunLimits, RunResultData, Tests

_UNCACHED = {RunStatus.sandbox_error, RunStatus.timeout}
V = TypeVar("V")


class LRU(Generic[V]):
    """A bounded mapping that forgets its least recently used entries."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.data: OrderedDict[str, V] = OrderedDict()

    def get(self, key: str) -> V | None:
        hit = self.data.get(key)
        if hit is not None:
            self.data.move_to_end(key)
        return hit

    def put(self, key: str, value: V) -> None:
        if self.entries <= 0:
            return
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.entries:
            self.data.popitem(last=False)


def unsafe_start(settings: Settings) -> str | None:
    """Why the service must not start with these settings here, or None.

    Without isolation a root server would run programs as uid 0.
    """
    if not settings.isolate and os.geteuid() == 0 and not settings.unsafe_no_isolation:
        return (
            "refusing to run programs as uid 0 without isolation: CRUCIBLE_SANDBOX_ISOLATE=false while "
            "running as root needs CRUCIBLE_SANDBOX_UNSAFE_NO_ISOLATION=true"
        )
    return None


class SandboxService:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.batch_slots = min(settings.batch_concurrency or max(1, settings.workers - 1), settings.workers)
        self.pool = WorkerPool(
            settings.workers,
            {
                "uid_base": settings.uid_base,
                "tmpfs_mb": settings.tmpfs_mb,
                "work_root": settings.work_root,
                "want_namespaces": settings.isolate,
                "want_cgroup": settings.isolate,
                "want_mount_namespace": settings.mount_namespace,
                "want_memory_cgroup": settings.memory_cgroup,
            },
            batch_slots=self.batch_slots,
            batch_nice=settings.batch_nice,
            batch_policy=settings.batch_policy,
        )
        self.cache: LRU[RunResultData] = LRU(settings.cache_entries)  # run results by `cache_key`
        self.valid_tests: LRU[bool] = LRU(4096)  # hashes of test suites known to parse
        # The toolchains found on the runs' PATH, less those the settings leave out.
        wanted = {"python", *(n.lower() for n in settings.languages)}
        self.languages = [n for n in languages.available() if not settings.languages or n in wanted]
        self.tenant_slots: dict[str, asyncio.Semaphore] = {}
        self.tenant_pending: dict[str, int] = {}
        # Per tenant: (monotonic end time, worker-seconds) of its runs of the last minute.
        self.tenant_usage: dict[str, deque[tuple[float, float]]] = {}

    async def start(self) -> None:
        refusal = unsafe_start(self.settings)
        if refusal:
            raise RuntimeError(refusal)
        if self.settings.isolate:
            await asyncio.to_thread(cgroups.remove_stale)  # left by servers that were killed
        await self.pool.start()
        metrics.WORKERS.set(self.settings.workers)

    async def stop(self) -> None:
        await self.pool.stop()
        cgroups.remove_empty_parents()

    @property
    def isolation(self) -> SandboxIsolation:
        """What `/health` says about isolation: the first slot's capabilities, and the mode."""
        info = self.pool.isolation
        out = SandboxIsolation(mode=info["mode"], **info["caps"]) if info else SandboxIsolation()
        if not self.settings.isolate and os.geteuid() == 0:
            out.mode, out.warning = "unsafe", "programs run as uid 0 without isolation (UNSAFE_NO_ISOLATION)"
        return out

    # -- validation ---------------------------------------------------------------------------
    def prepare(self, run: RunRequest, where: str = "") -> PreparedRun:
        """Check one run against the server's rules and resolve its limits. Raises ApiError."""
        s = self.settings
        language = self.language(run.language, run.tests.kind, where)
        if language != "python" and run.tests.kind == "run":
            # Python's alone: asked of another language they would be ignored, and the run pass.
            for field, asked in (
                ("cells", bool(run.tests.cells)),
                ("call", run.tests.call is not None),
                ("value", run.tests.value != "none"),
            ):
                if asked:
                    raise ApiError(
                        400,
                        f"{field} is for Python programs; a {language} program's output is its stdout",
                        field=f"{where}tests.{field}",
                        code="unsupported_tests",
                    )
        if len(run.code.encode()) > s.max_code_bytes:
            raise ApiError(413, f"code is larger than {s.max_code_bytes} bytes", field=f"{where}code")
        tests = cast(Tests, run.tests.model_dump(mode="json"))
        text = json.dumps(tests).encode()
        if len(text) > s.max_tests_bytes:
            raise ApiError(413, f"tests are larger than {s.max_tests_bytes} bytes", field=f"{where}tests")
        # Parsing every test again costs more than the rest of this function; RL batches and
        # retries send the same suites over and over.
        digest = hashlib.sha256(text).hexdigest()
        if not self.valid_tests.get(digest):
            self._check_tests(tests, f"{where}tests")
            self.valid_tests.put(digest, True)
        lim = run.limits
        wall = min(lim.wall_time_s or s.default_wall_time_s, s.max_wall_time_s)
        limits: RunLimits = {
            "wall_time_s": wall,
            "test_time_s": min(lim.test_time_s or s.default_test_time_s, wall),
            "cpu_time_s": min(lim.cpu_time_s or wall, s.max_wall_time_s),
            "memory_mb": min(lim.memory_mb or s.default_memory_mb, s.max_memory_mb),
            "output_bytes": min(
                lim.output_bytes if lim.output_bytes is not None else s.default_output_bytes,
                s.max_output_bytes,
            ),
            "report_bytes": s.max_report_bytes,
            "file_bytes": s.file_bytes,
            "open_files": s.open_files,
            "processes": s.processes,
        }
        prepared: PreparedRun = {"code": run.code, "tests": tests, "limits": limits}
        if language != "python":  # Python runs keep the keys (and cache keys) they always had
            prepared["language"] = language
            limits["compile_time_s"] = min(
                lim.compile_time_s or s.default_compile_time_s, s.max_compile_time_s
            )
            limits["compile_memory_mb"] = min(
                lim.compile_memory_mb or s.default_compile_memory_mb, s.max_compile_memory_mb
            )
        return prepared

    def language(self, name: str, kind: str, where: str = "") -> str:
        """The language a request names, if this server runs it with these tests. Raises ApiError."""
        if name.lower() == "python":
            return "python"
        lang = languages.resolve(name)
        if lang is None:
            raise ApiError(
                400,
                f"unsupported language {name!r}; supported: {', '.join(self.languages)}",
                field=f"{where}language",
                code="unsupported_language",
            )
        if lang["name"] not in self.languages:
            raise ApiError(
                400,
                f"language {lang['name']!r} is not available on this server: its toolchain ({lang['tool']}, "
                f"Debian package {lang['package']}) is not installed or not enabled (CRUCIBLE_SANDBOX_LANGUAGES); "
                f"available: {', '.join(self.languages)}",
                field=f"{where}language",
                code="language_unavailable",
            )
        if kind not in ("stdio", "run"):
            raise ApiError(
                400,
                f"tests of kind {kind!r} are for Python programs; a {lang['name']} program takes `stdio` or `run`",
                field=f"{where}tests.kind",
                code="unsupported_tests",
            )
        return lang["name"]

    @staticmethod
    def _check_tests(tests: Tests, where: str) -> None:
        """Test code must parse: a broken test is the caller's error (422), not the candidate's."""
        try:
            if tests["kind"] == "asserts":
                for i, source in enumerate(tests["asserts"]):
                    try:
                        ast.parse(source)
                    except SyntaxError as e:
                        raise ApiError(
                            422,
                            f"test {i} is not valid Python: {e.msg} (line {e.lineno})",
                            field=f"{where}.asserts.{i}",
                        ) from None
                ast.parse(tests.get("setup", ""))
            elif tests["kind"] == "check":
                plan_check(tests["check"])
        except SyntaxError as e:
            field = f"{where}.setup" if tests["kind"] == "asserts" else f"{where}.check"
            raise ApiError(422, f"not valid Python: {e.msg} (line {e.lineno})", field=field) from None
        except ValueError as e:
            raise ApiError(422, str(e), field=f"{where}.check") from None

    @staticmethod
    def cache_key(prepared: PreparedRun) -> str:
        return hashlib.sha256(json.dumps(prepared, sort_keys=True).encode()).hexdigest()

    # -- admission ----------------------------------------------------------------------------
    def quota(self, tenant: Tenant, name: str) -> float:
        """The tenant's own quota `name`, else this server's default for every tenant."""
        own = getattr(tenant.quotas, name)
        if own is not None:
            return own
        s = self.settings
        return {
            "concurrent_runs": s.per_key_concurrency or max(1, s.workers - 1),
            "queued_runs": s.tenant_queued_runs,
            "worker_seconds_per_minute": s.tenant_worker_seconds_per_minute,
        }[name]

    def used_last_minute(self, tenant: str, now: float) -> tuple[float, float]:
        """(worker-seconds the tenant's runs took over the last minute, seconds until the oldest of
        them leaves the window)."""
        window = self.tenant_usage.get(tenant)
        if not window:
            return 0.0, 0.0
        while window and window[0][0] < now - 60:
            window.popleft()
        return sum(seconds for _, seconds in window), (window[0][0] + 60 - now) if window else 0.0

    def _refuse(self, tenant: Tenant, quota: str, message: str, retry_s: float) -> ApiError:
        metrics.REJECTED.inc()
        metrics.TENANT_REJECTED.labels(tenant.name, quota).inc()
        return ApiError(429, message, headers={"Retry-After": str(max(1, int(retry_s + 0.999)))})

    @asynccontextmanager
    async def admit(self, count: int, tenant: Tenant = ANONYMOUS):
        """Reserve queue room for `count` runs of `tenant`, or answer 429 with Retry-After naming
        the queue or the tenant's quota that is full."""
        pool, name = self.pool, tenant.name
        retry = max(1, int(pool.pending / max(self.settings.workers, 1) * 0.05) + 1)
        mine = self.tenant_pending.get(name, 0)
        queued = self.quota(tenant, "queued_runs")
        if mine + count > queued:
            raise self._refuse(
                tenant,
                "queued_runs",
                f"tenant {name} has {mine} runs pending and {count} more would exceed its queued_runs "
                f"quota of {int(queued)}; retry later or send smaller batches",
                retry,
            )
        seconds = self.quota(tenant, "worker_seconds_per_minute")
        if seconds:
            used, frees_in = self.used_last_minute(name, time.monotonic())
            if used >= seconds:
                raise self._refuse(
                    tenant,
                    "worker_seconds_per_minute",
                    f"tenant {name} used {used:.1f} worker-seconds in the last minute, its "
                    f"worker_seconds_per_minute quota is {seconds:g}; retry later",
                    frees_in,
                )
        if pool.pending + count > self.settings.queue_size:
            raise self._refuse(
                tenant,
                "queue_size",
                f"the sandbox queue is full ({pool.pending} runs pending); retry later",
                retry,
            )
        pool.pending += count
        self.tenant_pending[name] = mine + count
        metrics.QUEUE.set(pool.pending)
        metrics.TENANT_PENDING.labels(name).set(mine + count)
        try:
            yield
        finally:
            pool.pending -= count
            left = self.tenant_pending[name] - count
            if left:
                self.tenant_pending[name] = left
            else:
                del self.tenant_pending[name]
            metrics.QUEUE.set(pool.pending)
            metrics.TENANT_PENDING.labels(name).set(left)

    def _tenant_slot(self, tenant: Tenant) -> asyncio.Semaphore:
        if tenant.name not in self.tenant_slots:
            self.tenant_slots[tenant.name] = asyncio.Semaphore(int(self.quota(tenant, "concurrent_runs")))
        return self.tenant_slots[tenant.name]

    # -- execution ----------------------------------------------------------------------------
    async def execute(
        self, prepared: PreparedRun, use_cache: bool, tenant: Tenant = ANONYMOUS, batch: bool = False
    ) -> RunResult:
        # The cache is partitioned by tenant: a hit must not tell one tenant what another ran.
        scope = "shared" if tenant.share_cache else f"tenant:{tenant.name}"
        cache_key = f"{scope}:{self.cache_key(prepared)}"
        if use_cache and self.settings.cache_entries:
            hit = self.cache.get(cache_key)
            if hit is not None:
                metrics.CACHE.labels("hit").inc()
                return RunResult.model_validate({**hit, "cached": True})
            metrics.CACHE.labels("miss").inc()
        started = time.perf_counter()
        async with self._tenant_slot(tenant):
            # The worker's compile cache is partitioned as the result cache is.
            raw = await self.pool.run({**prepared, "cache_scope": scope}, batch, tenant.name)
        result = RunResult.model_validate(raw)
        worker_s, now = result.duration_ms / 1000, time.monotonic()
        self.tenant_usage.setdefault(tenant.name, deque()).append((now, worker_s))
        self.used_last_minute(tenant.name, now)  # drops what left the window
        metrics.RUNS.labels(result.status.value).inc()
        metrics.RUN_SECONDS.observe(time.perf_counter() - started)
        metrics.TENANT_RUNS.labels(tenant.name, result.status.value).inc()
        metrics.TENANT_WORKER_SECONDS.labels(tenant.name).inc(worker_s)
        if result.status not in _UNCACHED:
            self.cache.put(cache_key, raw)
        return result

    async def run_one(self, run: RunRequest, tenant: Tenant = ANONYMOUS) -> RunResult:
        prepared = self.prepare(run)
        async with self.admit(1, tenant):
            return await self.execute(prepared, run.use_cache, tenant)

    async def run_batch(self, runs: list[RunRequest], tenant: Tenant = ANONYMOUS) -> list[RunResult]:
        if len(runs) > self.settings.max_batch_runs:
            raise ApiError(413, f"a batch holds at most {self.settings.max_batch_runs} runs", field="runs")
        prepared = []
        for i, r in enumerate(runs):
            prepared.append(self.prepare(r, f"runs.{i}."))
            if i % 32 == 31:
                await asyncio.sleep(0)  # a single run arriving meanwhile is not held behind a large batch
        async with self.admit(len(runs), tenant):
            gate = asyncio.Semaphore(self.batch_slots)

            async def one(p: PreparedRun, use_cache: bool) -> RunResult:
                async with gate:
                    return await self.execute(p, use_cache, tenant, batch=True)

            return list(
                await asyncio.gather(*(one(p, r.use_cache) for p, r in zip(prepared, runs, strict=True)))
            )
