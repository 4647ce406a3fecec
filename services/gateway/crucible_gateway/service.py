"""Gateway logic, independent of HTTP: submit, view, list, cancel, retry, reap, artifacts, adapters.

Reads never write. A job whose worker went silent is moved on by `reap`, an explicit transition
the app runs on a timer: back to the queue (resuming from its checkpoint) while it has attempts
left, else `failed` with a retry hint.

Silence is measured on Redis's clock (the one heartbeats are stamped with) and only while Redis
was reachable: after Redis restarts, or after the reaper itself could not reach it, no running job
is reaped until a whole heartbeat timeout has passed with Redis up, so the heartbeats that failed
during an outage are not mistaken for a dead worker. A run that is re-queued anyway (its worker
was cut off from Redis alone) is fenced by its lease and stops (`crucible_shared.lifecycle`).

Every job belongs to the tenant that submitted it (`crucible_shared.tenants`): every method that
names a job takes the caller's tenant, and a job of another tenant is answered exactly like one
that does not exist (404). An admin tenant sees every job. Quotas (active jobs, spec size) are
checked at submission: a 429 naming the quota, with Retry-After. They hold across gateway
replicas: active jobs are counted from Redis, and a tenant's submissions are checked and created
one at a time under a Redis lock; open event streams are leases in Redis (`StreamLease`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from crucible_shared import keys, served
from crucible_shared.distributed import too_many_ranks
from crucible_shared.gateway_protocol import AdapterView, Artifact
from crucible_shared.http import ApiError
from crucible_shared.jobs import DPOConfig, EvalJob, PipelineJob, SFTConfig, TrainJob
from crucible_shared.lifecycle import FINAL, JobKind, JobRecord, JobStatus, valid_job_id
from crucible_shared.paths import JobPathError, UnsafePath, open_dir_inside, open_file_inside
from crucible_shared.tenants import ANONYMOUS, Tenant
from prometheus_client import Counter, Gauge

from crucible_gateway.settings import Settings
from crucible_gateway.store import IdempotencyConflict, JobStore
from crucible_gateway.work import job_work

log = logging.getLogger(__name__)
REJECTED = Counter(
    "crucible_gateway_tenant_rejected_total",
    "Requests refused with 429, by tenant and quota.",
    ["tenant", "quota"],
)
STREAMS = Gauge(
    "crucible_gateway_tenant_event_streams", "Event streams open on this gateway, by tenant.", ["tenant"]
)
# An open stream renews its lease this often; a gateway that dies stops renewing, and its
# streams stop counting against their tenants' quotas once their leases lapse.
LEASE_S = 60.0
RENEW_S = LEASE_S / 3


class StreamLease:
    """One open event stream's slot of its tenant's `event_streams` quota, held in Redis so that
    every gateway replica counts the same streams (`GatewayService.open_stream`)."""

    def __init__(self, service: GatewayService, tenant: str, lease: str) -> None:
        self.service, self.tenant, self.lease = service, tenant, lease
        self.renewed = time.monotonic()

    async def keep(self) -> None:
        """Renew the lease when it is due (called from the stream's poll loop)."""
        if time.monotonic() - self.renewed >= RENEW_S:
            self.renewed = time.monotonic()
            await self.service.store.renew_lease(self.tenant, self.lease, LEASE_S)

    async def release(self) -> None:
        """Give the slot back (a Redis blip leaves it to lapse)."""
        self.service.streams[self.tenant] -= 1
        STREAMS.labels(self.tenant).set(self.service.streams[self.tenant])
        try:
            await self.service.store.drop_lease(self.tenant, self.lease)
        except Exception as exc:
            log.warning("could not give back an event stream of %s: %r", self.tenant, exc)


def check_job_id(job_id: str) -> None:
    if not valid_job_id(job_id):
        raise ApiError(
            422, f"{job_id[:80]!r} is not a job id (letters, digits, `_`, `.`, `-`)", field="job_id"
        )


_VERSION_DIR = re.compile(r"^v(\d+)(?:-r\d+)?$")


def training_steps(spec: TrainJob | EvalJob | PipelineJob) -> list[tuple[str, int]]:
    """The fields that set how many steps a job trains for, with their values.

    >>> training_steps(TrainJob.model_validate({"optim": {"steps": 7}}))
    [('optim.steps', 7)]
    """
    if isinstance(spec, TrainJob):
        if isinstance(spec.method, SFTConfig | DPOConfig):
            return [("method.max_steps", spec.method.max_steps)] if spec.method.max_steps else []
        return [("optim.steps", spec.optim.steps)]
    if isinstance(spec, PipelineJob) and spec.train.max_steps:
        return [("train.max_steps", spec.train.max_steps)]
    return []


class GatewayService:
    def __init__(self, settings: Settings, store: JobStore) -> None:
        self.settings, self.store = settings, store
        self.roots = settings.path_roots()
        self.tenants = settings.tenant_table()
        # Redis time since which every reap reached Redis (None: the last one did not).
        self.reachable_since: float | None = float("-inf")
        self.streams: dict[str, int] = {}  # tenant -> event streams open on this gateway (the gauge)

    def redis_lost(self) -> None:
        """The reaper could not reach Redis: heartbeats may be failing too."""
        self.reachable_since = None

    # -- quotas -----------------------------------------------------------------------------------
    def quota(self, tenant: Tenant, name: str) -> int:
        """The tenant's own quota `name`, else this gateway's default for every tenant."""
        own = getattr(tenant.quotas, name)
        if own is not None:
            return int(own)
        s = self.settings
        return {
            "active_jobs": s.tenant_active_jobs,
            "spec_bytes": s.tenant_spec_bytes,
            "event_streams": s.tenant_event_streams,
        }[name]

    @staticmethod
    def over_quota(tenant: Tenant, quota: str, message: str, retry_s: int) -> ApiError:
        REJECTED.labels(tenant.name, quota).inc()
        return ApiError(
            429,
            f"tenant {tenant.name}: {message} ({quota} quota)",
            field=quota,
            headers={"Retry-After": str(retry_s)},
        )

    @asynccontextmanager
    async def quota_checked(self, tenant: Tenant, payload: dict) -> AsyncIterator[None]:
        """`check_quotas`, with the tenant's Redis lock held until the block (which creates or
        re-queues the job) ends: two replicas cannot both let the tenant's last job in."""
        async with self.store.tenant_lock(tenant.name) as held:
            if not held:
                raise ApiError(
                    503,
                    f"tenant {tenant.name}: another submission is being checked; try again",
                    code="unavailable",
                    headers={"Retry-After": "1"},
                )
            await self.check_quotas(tenant, payload)
            yield

    async def check_quotas(self, tenant: Tenant, payload: dict) -> None:
        size, cap = len(json.dumps(payload)), self.quota(tenant, "spec_bytes")
        if size > cap:
            raise self.over_quota(tenant, "spec_bytes", f"the job spec is {size} bytes, over {cap}", 3600)
        cap = self.quota(tenant, "active_jobs")
        active = len(await self.store.ids(JobStatus.queued, tenant.name)) + len(
            await self.store.ids(JobStatus.running, tenant.name)
        )
        if active >= cap:
            raise self.over_quota(
                tenant, "active_jobs", f"{active} jobs queued or running, the most allowed is {cap}", 60
            )

    async def open_stream(self, tenant: Tenant) -> StreamLease:
        """A slot of the tenant's `event_streams` quota, counted across replicas in Redis, for as
        long as the stream is open (429 when full); the stream releases it when it ends."""
        cap, lease = self.quota(tenant, "event_streams"), uuid.uuid4().hex
        taken, now = await self.store.take_lease(tenant.name, lease, cap, LEASE_S)
        if not taken:
            raise self.over_quota(
                tenant, "event_streams", f"{now} event streams open, the most allowed is {cap}", 5
            )
        self.streams[tenant.name] = self.streams.get(tenant.name, 0) + 1
        STREAMS.labels(tenant.name).set(self.streams[tenant.name])
        return StreamLease(self, tenant.name, lease)

    # -- jobs -------------------------------------------------------------------------------------
    async def submit(
        self, spec: TrainJob | EvalJob | PipelineJob, idempotency_key: str | None, tenant: Tenant = ANONYMOUS
    ) -> tuple[str, bool]:
        try:
            paths = await asyncio.to_thread(self.roots.check_present, spec)
        except JobPathError as exc:
            raise ApiError(422, exc.message, field=f"{spec.kind}.{exc.field}") from None
        self.check_length(spec)
        await asyncio.to_thread(self.check_work, spec, paths)
        if isinstance(spec, PipelineJob) and spec.reuse:
            await self.check_reuse(spec.reuse, tenant)
        if isinstance(spec, TrainJob) and spec.distributed.train_gpus > 1:
            await self._check_ranks(spec.distributed.train_gpus)
        if isinstance(spec, EvalJob):  # evaluated where the generators serve it, not loaded
            await self._check_served(spec.model.base, "eval.model.base")
        await self._check_installed(spec.model.base, f"{spec.kind}.model.base")
        attempts = spec.max_attempts or self.settings.max_attempts
        payload = spec.model_dump(mode="json")
        try:
            async with self.quota_checked(tenant, payload):
                job_id, created = await self.store.create(
                    spec.kind, payload, spec.name, idempotency_key, attempts, tenant.name
                )
        except IdempotencyConflict as exc:
            raise ApiError(
                409,
                f"Idempotency-Key {idempotency_key!r} already submitted job {exc.job_id} with a different "
                "spec; use a new key for a new job",
                field="Idempotency-Key",
                code="conflict",
            ) from None
        if created:
            await self.publish_timeout()
            await asyncio.to_thread(self.store.enqueue, spec.kind, job_id, payload)
        return job_id, created

    def check_length(self, spec: TrainJob | EvalJob | PipelineJob) -> None:
        """Refuse a job longer than this gateway's cap (`max_steps`), naming the field."""
        cap = self.settings.max_steps
        for field, steps in training_steps(spec):
            if steps > cap:
                raise ApiError(
                    422,
                    f"{steps} steps is over this gateway's cap of {cap} (CRUCIBLE_GATEWAY_MAX_STEPS); "
                    "ask for fewer, or continue from this job's adapter in a new job (model.init_adapter)",
                    field=f"{spec.kind}.{field}",
                )

    def check_work(self, spec: TrainJob | EvalJob | PipelineJob, paths: dict[str, Path]) -> None:
        """Refuse a job asking for more tokens than `max_work_tokens` (`crucible_gateway.work`),
        naming the field that sets its length."""

        def lines(field: str, _value: str) -> int | None:
            path = paths.get(field.split(".", 1)[1])
            root = next((r for r in self.roots.of("data") if path and r in path.parents), None)
            if path is None or root is None:
                return None  # a file only the workers see: counted as `limit`, else one task
            try:  # read through the checked descriptor (links refused), never the path again
                fd = open_file_inside(root, str(path.relative_to(root)))
            except UnsafePath:
                return None
            with os.fdopen(fd, "rb") as f:
                return sum(1 for line in f if line.strip())

        found = job_work(spec, lines)
        cap = self.settings.max_work_tokens
        if found is not None and found[1] > cap:
            field, tokens, how = found
            raise ApiError(
                422,
                f"the job asks for about {tokens:,} tokens ({how}), over this gateway's cap of {cap:,} "
                "(CRUCIBLE_GATEWAY_MAX_WORK_TOKENS); ask for less, or split it into several jobs",
                field=field,
            )

    async def check_reuse(self, reuse: str, tenant: Tenant = ANONYMOUS) -> None:
        """`reuse` names an earlier pipeline job of the tenant whose run dir has its stage records."""
        field = "pipeline.reuse"
        record = await self.store.get(reuse)
        if record is not None and not tenant.sees(record.tenant):
            record = None
        if record is None or record.kind != JobKind.pipeline:
            what = f"is a job of kind {record.kind.value}" if record else "names no job"
            raise ApiError(
                422,
                f"{reuse!r} {what}: reuse names an earlier pipeline job (GET /v1/jobs?kind=pipeline)",
                field=field,
            )
        try:
            fd = await asyncio.to_thread(
                open_file_inside, Path(self.settings.runs_dir), f"{reuse}/pipeline.json"
            )
            os.close(fd)
        except UnsafePath:
            raise ApiError(
                422,
                f"pipeline job {reuse} ({record.status.value}) has no stage records to reuse yet "
                "(its run dir has no pipeline.json)",
                field=field,
            ) from None

    async def _check_ranks(self, asked: int) -> None:
        """Refuse a job no live worker can launch; with no worker up yet, the job waits in the
        queue and the worker that takes it checks again."""
        reported = await asyncio.to_thread(self.store.worker_ranks)
        if reported and asked > max(reported):
            raise ApiError(422, too_many_ranks(asked, max(reported)), field="train.distributed.train_gpus")

    async def _check_installed(self, base: str, field: str) -> None:
        """Refuse a model that live workers report as installable but not installed (by
        `crucible models install`) on any of them; with no report, the worker that takes the job
        fails it with the same advice."""
        name = base.lower()
        installed, missing = await asyncio.to_thread(self.store.worker_models)
        if name in missing and name not in installed:
            raise ApiError(
                422,
                f"model {name} is not installed on the trainer workers: run `crucible models install "
                f"{name}` where they run (it downloads, verifies and dequantises it once)",
                field=field,
            )

    async def _check_served(self, base: str, field: str) -> None:
        """Refuse an evaluation of a base model no generator serves: an eval job evaluates what
        the generators serve under the name `model.base` gives. Live trainer workers report what
        their generators serve (`crucible_shared.keys.worker_served`); with no fresh report (no
        worker up, no generator answering it) the worker that takes the job checks at its start."""
        reports = await asyncio.to_thread(self.store.worker_served)
        cards = [card for report in reports for card in report]
        if not reports or any(served.same_model(base, c["id"], c.get("root")) for c in cards):
            return
        unique = list({(c["id"], c.get("root")): c for c in cards}.values())
        raise ApiError(
            422,
            f"model.base is {base!r} but the generators serve {served.describe(unique)}: submit the "
            f"job with model.base set to that model, or start the generators with {base!r}",
            field=field,
        )

    async def view(self, job_id: str, with_spec: bool = True, tenant: Tenant = ANONYMOUS) -> JobRecord:
        """The job, if `tenant` may see it; another tenant's job is a 404 like a missing one."""
        check_job_id(job_id)
        record = await self.store.get(job_id)
        if record is None or not tenant.sees(record.tenant):
            raise ApiError(404, f"no job {job_id!r}", field="job_id")
        return record if with_spec else record.model_copy(update={"spec": None})

    async def list_jobs(
        self,
        status: JobStatus | None,
        kind: JobKind | None,
        offset: int,
        limit: int,
        tenant: Tenant = ANONYMOUS,
    ) -> tuple[list[JobRecord], int]:
        owner = None if tenant.admin else tenant.name
        if kind is None and owner is None:
            ids, total = await self.store.page(status, offset, limit)
        else:
            ids = await self.store.ids(status, owner)
            if kind is not None:
                # Filtered on the one field it needs: whole records (specs) are read for one page only.
                ids = [r["id"] for r in await self.store.fields(ids, ("kind",)) if r["kind"] == kind.value]
            ids, total = ids[offset : offset + limit], len(ids)
        records = await self.store.get_many(ids)
        return [r.model_copy(update={"spec": None}) for r in records], total

    async def cancel(self, job_id: str, tenant: Tenant = ANONYMOUS) -> JobRecord:
        record = await self.view(job_id, tenant=tenant)
        if record.status in FINAL:
            raise ApiError(
                409, f"job {job_id} already {record.status.value}", field="job_id", code="conflict"
            )
        await self.store.request_cancel(job_id)
        if record.status == JobStatus.queued and await asyncio.to_thread(self.store.cancel_queued, job_id):
            await self.store.transition(
                job_id, JobStatus.cancelled, allowed_from={JobStatus.queued}, finished_at=time.time()
            )
        return await self.view(job_id, tenant=tenant)

    async def retry(self, job_id: str, tenant: Tenant = ANONYMOUS) -> JobRecord:
        record = await self.view(job_id, tenant=tenant)
        if record.status not in (JobStatus.failed, JobStatus.cancelled):
            raise ApiError(
                409,
                f"only failed or cancelled jobs can be retried; {job_id} is {record.status.value}",
                field="job_id",
                code="conflict",
            )
        async with self.quota_checked(tenant, record.spec or {}):
            await self.store.clear_cancel(job_id)
            changed, now = await self.store.transition(
                job_id,
                JobStatus.queued,
                allowed_from={JobStatus.failed, JobStatus.cancelled},
                attempts=record.attempts + 1,
                max_attempts=max(record.max_attempts, record.attempts + 1),
                error=None,
                finished_at=None,
                queued_at=time.time(),
            )
        if not changed:
            raise ApiError(
                409, f"job {job_id} is {now.value if now else 'gone'}", field="job_id", code="conflict"
            )
        await self.publish_timeout()
        await asyncio.to_thread(self.store.enqueue, record.kind, job_id, record.spec or {})
        return await self.view(job_id, tenant=tenant)

    async def publish_timeout(self) -> None:
        """Running jobs hold their lease for at most half of the reaper's heartbeat timeout
        (crucible_trainer.runtime.channel), so a run cut off from Redis stops writing before this reaper
        can re-queue its job: the timeout is in Redis before any job can start (at each
        submission) and stays current (at each reap)."""
        await self.store.redis.set(keys.heartbeat_timeout(), repr(float(self.settings.heartbeat_timeout_s)))

    async def reap(self, now: float | None = None) -> list[tuple[str, JobStatus]]:
        """Move on jobs whose worker is gone; returns (job id, new status) of each change.

        Reads only ids and timestamps (`JobStore.fields`); a whole record (its spec) is read only
        for a job that is moved back on its queue, so a flood of queued jobs costs a pipeline of
        small replies, not parsing every spec every few seconds."""
        if now is None:
            now, uptime = await self.store.clock()
        else:
            uptime = float("inf")
        if self.reachable_since is None:
            self.reachable_since = now
        await self.publish_timeout()
        cutoff = now - self.settings.heartbeat_timeout_s
        changes: list[tuple[str, JobStatus]] = []
        # Within a heartbeat timeout of Redis coming back, silence proves nothing.
        trusted = max(self.reachable_since, now - uptime) <= cutoff
        running = await self.store.ids(JobStatus.running) if trusted else []
        beats = await self.store.fields(
            running, ("heartbeat_at", "started_at", "created_at", "attempts", "max_attempts", "step")
        )
        for row in beats:
            beat = row["heartbeat_at"] or row["started_at"] or row["created_at"] or 0
            if beat >= cutoff:
                continue
            job_id, attempts, max_attempts = row["id"], row["attempts"] or 1, row["max_attempts"] or 1
            where = f" at step {row['step']}" if row["step"] else ""
            lost = f"the worker running it stopped reporting{where} (killed or crashed)"
            if attempts < max_attempts:
                attempt = attempts + 1
                changed, _ = await self.store.transition(
                    job_id,
                    JobStatus.queued,
                    allowed_from={JobStatus.running},
                    stale_before=cutoff,
                    attempts=attempt,
                    error=f"{lost}; retried automatically (attempt {attempt} of {max_attempts})",
                    queued_at=now,
                )
                record = await self.store.get(job_id) if changed else None
                if record is not None:
                    await asyncio.to_thread(self.store.enqueue, record.kind, job_id, record.spec or {})
                    await self.store.emit(job_id, "requeued", attempt=attempt, reason=lost)
                    changes.append((job_id, JobStatus.queued))
            else:
                error = f"{lost}; POST /v1/jobs/{job_id}/retry resumes from the last checkpoint"
                changed, _ = await self.store.transition(
                    job_id,
                    JobStatus.failed,
                    allowed_from={JobStatus.running},
                    stale_before=cutoff,
                    error=error,
                    finished_at=now,
                )
                if changed:
                    await self.store.emit(job_id, "status", status="failed", error=error)
                    changes.append((job_id, JobStatus.failed))
        # Queued jobs whose RQ job is gone: one a stopping worker released (its RQ job finished)
        # goes back on its queue; one that failed before it started is failed. Only jobs queued
        # for a while (`queue_settle_s`), so a submission or retry still between its record and its
        # enqueue is left be.
        queued = await self.store.fields(await self.store.ids(JobStatus.queued), ("queued_at", "created_at"))
        settle = now - self.settings.queue_settle_s
        settled = [r["id"] for r in queued if (r["queued_at"] or r["created_at"] or 0) < settle]
        statuses = await asyncio.to_thread(self.store.rq_statuses, settled)
        for job_id in settled:
            rq = statuses[job_id]
            if rq in (None, "finished"):
                record = await self.store.get(job_id)
                if record is not None and record.status == JobStatus.queued:
                    await asyncio.to_thread(self.store.enqueue, record.kind, job_id, record.spec or {})
                    changes.append((job_id, JobStatus.queued))
            elif rq in ("failed", "stopped"):
                error = "the job failed before it started (see the worker log)"
                changed, _ = await self.store.transition(
                    job_id, JobStatus.failed, allowed_from={JobStatus.queued}, error=error, finished_at=now
                )
                if changed:
                    changes.append((job_id, JobStatus.failed))
        return changes

    # -- files ------------------------------------------------------------------------------------
    async def check_run_dir(self, job_id: str, tenant: Tenant) -> None:
        """404 unless the job exists and `tenant` may see it."""
        await self.view(job_id, with_spec=False, tenant=tenant)

    def artifacts(self, job_id: str, base_url: str) -> list[Artifact]:
        """Regular files under the job's run dir. The run dir is opened without following a link
        (a run dir that is a link lists nothing), and the tree is walked by descriptor: links are
        neither followed nor listed."""
        runs = Path(self.settings.runs_dir)
        try:
            top = open_dir_inside(runs, job_id)
        except UnsafePath:
            return []
        out = []
        try:
            for folder, dirs, files, dir_fd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    try:
                        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    except OSError:
                        continue
                    if name.startswith(".") or not stat.S_ISREG(info.st_mode):
                        continue
                    rel = os.path.normpath(os.path.join(folder, name))
                    url = f"{base_url}/v1/jobs/{job_id}/artifacts/{rel}"
                    out.append(Artifact(path=rel, size=info.st_size, url=url))
        finally:
            os.close(top)
        return sorted(out, key=lambda a: a.path)

    def open_artifact(self, job_id: str, rel: str) -> int:
        """An open descriptor of the file `rel` names under the job's run dir: a regular file inside
        it, reached without links. The response is read from this descriptor, never from the path.

        Every refusal (absolute, `..`, link, special file, missing) is the same 404, so an
        answer tells nothing about what exists outside the run dir.
        """
        try:
            return open_file_inside(Path(self.settings.runs_dir), f"{job_id}/{rel}")
        except UnsafePath:
            raise ApiError(404, f"no artifact {rel[:200]!r} for job {job_id}", field="path") from None

    async def adapters(self, tenant: Tenant = ANONYMOUS) -> list[AdapterView]:
        """Adapter versions in the store, of the jobs `tenant` may see."""
        found = await asyncio.to_thread(self._adapter_dirs)
        if not tenant.admin:
            job_ids = sorted({a.job_id for a in found if valid_job_id(a.job_id)})
            owners = {r["id"]: r["tenant"] for r in await self.store.fields(job_ids, ("tenant",))}
            found = [a for a in found if a.job_id in owners and tenant.sees(owners[a.job_id])]
        return found

    def _adapter_dirs(self) -> list[AdapterView]:
        root = Path(self.settings.adapter_dir)
        out = []
        if root.exists():
            for job_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
                for version_dir in sorted(job_dir.glob("v*")):
                    # `v<step>`, or `v<step>-r<token>` from a later run of the job (docs/jobs.md).
                    found = _VERSION_DIR.match(version_dir.name)
                    if found and (version_dir / "adapter_config.json").exists():
                        out.append(
                            AdapterView(
                                name=f"{job_dir.name}-{version_dir.name}",
                                job_id=job_dir.name,
                                version=int(found.group(1)),
                                path=str(version_dir),
                            )
                        )
        return out
