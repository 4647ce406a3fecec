"""Gateway logic, independent of HTTP: submit, view, list, cancel, retry, reap, artifacts, adapters.

Reads never write. A job whose worker went silent is moved on by `reap`, an explicit transition
the app runs on a timer: back to the queue (resuming from its checkpoint) while it has attempts
left, else `failed` with a retry hint.

Silence is measured on Redis's clock (the one heartbeats are stamped with) and only while Redis
was reachable: after Redis restarts, or after the reaper itself could not reach it, no running job
is reaped until a whole heartbeat timeout has passed with Redis up, so the heartbeats that failed
during an outage are not mistaken for a dead worker. A run that is re-queued anyway (its worker
was cut off from Redis alone) is fenced by its lease and stops (`crucible_shared.lifecycle`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import time
from pathlib import Path

from crucible_shared import keys
from crucible_shared.distributed import too_many_ranks
from crucible_shared.gateway_protocol import AdapterView, Artifact
from crucible_shared.http import ApiError
from crucible_shared.jobs import DPOConfig, EvalJob, PipelineJob, SFTConfig, TrainJob
from crucible_shared.lifecycle import FINAL, JobKind, JobRecord, JobStatus, valid_job_id
from crucible_shared.paths import JobPathError, UnsafePath, file_inside

from crucible_gateway.settings import Settings
from crucible_gateway.store import JobStore
from crucible_gateway.work import job_work

log = logging.getLogger(__name__)
QUEUE_SETTLE_S = 10.0


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
        # Redis time since which every reap reached Redis (None: the last one did not).
        self.reachable_since: float | None = float("-inf")

    def redis_lost(self) -> None:
        """The reaper could not reach Redis: heartbeats may be failing too."""
        self.reachable_since = None

    # -- jobs -------------------------------------------------------------------------------------
    async def submit(
        self, spec: TrainJob | EvalJob | PipelineJob, idempotency_key: str | None
    ) -> tuple[str, bool]:
        try:
            paths = await asyncio.to_thread(self.roots.check_present, spec)
        except JobPathError as exc:
            raise ApiError(422, exc.message, field=f"{spec.kind}.{exc.field}") from None
        self.check_length(spec)
        await asyncio.to_thread(self.check_work, spec, paths)
        if isinstance(spec, PipelineJob) and spec.reuse:
            await self.check_reuse(spec.reuse)
        if isinstance(spec, TrainJob) and spec.distributed.train_gpus > 1:
            await self._check_ranks(spec.distributed.train_gpus)
        attempts = spec.max_attempts or self.settings.max_attempts
        payload = spec.model_dump(mode="json")
        job_id, created = await self.store.create(spec.kind, payload, spec.name, idempotency_key, attempts)
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
            if path is None or not path.is_file():
                return None  # a file only the workers see: counted as `limit`, else one task
            with path.open("rb") as f:
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

    async def check_reuse(self, reuse: str) -> None:
        """`reuse` names an earlier pipeline job whose run dir has its stage records."""
        field = "pipeline.reuse"
        record = await self.store.get(reuse)
        if record is None or record.kind != JobKind.pipeline:
            what = f"is a job of kind {record.kind.value}" if record else "names no job"
            raise ApiError(
                422,
                f"{reuse!r} {what}: reuse names an earlier pipeline job (GET /v1/jobs?kind=pipeline)",
                field=field,
            )
        try:
            await asyncio.to_thread(file_inside, Path(self.settings.runs_dir), f"{reuse}/pipeline.json")
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

    async def view(self, job_id: str, with_spec: bool = True) -> JobRecord:
        check_job_id(job_id)
        record = await self.store.get(job_id)
        if record is None:
            raise ApiError(404, f"no job {job_id!r}", field="job_id")
        return record if with_spec else record.model_copy(update={"spec": None})

    async def list_jobs(
        self, status: JobStatus | None, kind: JobKind | None, offset: int, limit: int
    ) -> tuple[list[JobRecord], int]:
        if kind is None:
            ids, total = await self.store.page(status, offset, limit)
            records = await self.store.get_many(ids)
        else:
            # Kinds are few; records of one status (or all) are filtered by kind in one pipeline.
            matching = [r for r in await self.store.get_many(await self.store.ids(status)) if r.kind == kind]
            records, total = matching[offset : offset + limit], len(matching)
        return [r.model_copy(update={"spec": None}) for r in records], total

    async def cancel(self, job_id: str) -> JobRecord:
        record = await self.view(job_id)
        if record.status in FINAL:
            raise ApiError(
                409, f"job {job_id} already {record.status.value}", field="job_id", code="conflict"
            )
        await self.store.request_cancel(job_id)
        if record.status == JobStatus.queued and await asyncio.to_thread(self.store.cancel_queued, job_id):
            await self.store.transition(
                job_id, JobStatus.cancelled, allowed_from={JobStatus.queued}, finished_at=time.time()
            )
        return await self.view(job_id)

    async def retry(self, job_id: str) -> JobRecord:
        record = await self.view(job_id)
        if record.status not in (JobStatus.failed, JobStatus.cancelled):
            raise ApiError(
                409,
                f"only failed or cancelled jobs can be retried; {job_id} is {record.status.value}",
                field="job_id",
                code="conflict",
            )
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
        return await self.view(job_id)

    async def publish_timeout(self) -> None:
        """Running jobs hold their lease for at most half of the reaper's heartbeat timeout
        (crucible_trainer.channel), so a run cut off from Redis stops writing before this reaper
        can re-queue its job: the timeout is in Redis before any job can start (at each
        submission) and stays current (at each reap)."""
        await self.store.redis.set(keys.heartbeat_timeout(), repr(float(self.settings.heartbeat_timeout_s)))

    async def reap(self, now: float | None = None) -> list[tuple[str, JobStatus]]:
        """Move on jobs whose worker is gone; returns (job id, new status) of each change."""
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
        for record in await self.store.get_many(running):
            beat = record.heartbeat_at or record.started_at or record.created_at
            if beat >= cutoff:
                continue
            where = f" at step {record.step}" if record.step else ""
            lost = f"the worker running it stopped reporting{where} (killed or crashed)"
            if record.attempts < record.max_attempts:
                attempt = record.attempts + 1
                changed, _ = await self.store.transition(
                    record.id,
                    JobStatus.queued,
                    allowed_from={JobStatus.running},
                    stale_before=cutoff,
                    attempts=attempt,
                    error=f"{lost}; retried automatically (attempt {attempt} of {record.max_attempts})",
                    queued_at=now,
                )
                if changed:
                    await asyncio.to_thread(self.store.enqueue, record.kind, record.id, record.spec or {})
                    await self.store.emit(record.id, "requeued", attempt=attempt, reason=lost)
                    changes.append((record.id, JobStatus.queued))
            else:
                error = f"{lost}; POST /v1/jobs/{record.id}/retry resumes from the last checkpoint"
                changed, _ = await self.store.transition(
                    record.id,
                    JobStatus.failed,
                    allowed_from={JobStatus.running},
                    stale_before=cutoff,
                    error=error,
                    finished_at=now,
                )
                if changed:
                    await self.store.emit(record.id, "status", status="failed", error=error)
                    changes.append((record.id, JobStatus.failed))
        # Queued jobs whose RQ job is gone: one a stopping worker released (its RQ job finished)
        # goes back on its queue; one that failed before it started is failed. Only jobs queued
        # for a while, so a submission or retry still between its record and its enqueue is left be.
        settled = [
            r
            for r in await self.store.get_many(await self.store.ids(JobStatus.queued))
            if (r.queued_at or r.created_at) < now - QUEUE_SETTLE_S
        ]
        statuses = await self.store.rq_statuses([r.id for r in settled])
        for record in settled:
            rq = statuses[record.id]
            if rq in (None, "finished"):
                await asyncio.to_thread(self.store.enqueue, record.kind, record.id, record.spec or {})
                changes.append((record.id, JobStatus.queued))
            elif rq in ("failed", "stopped"):
                error = "the job failed before it started (see the worker log)"
                changed, _ = await self.store.transition(
                    record.id, JobStatus.failed, allowed_from={JobStatus.queued}, error=error, finished_at=now
                )
                if changed:
                    changes.append((record.id, JobStatus.failed))
        return changes

    # -- files ------------------------------------------------------------------------------------
    async def run_dir(self, job_id: str) -> Path:
        await self.view(job_id, with_spec=False)
        return Path(self.settings.runs_dir) / job_id

    def artifacts(self, root: Path, job_id: str, base_url: str) -> list[Artifact]:
        """Regular files under the run dir; links are neither followed nor listed."""
        if not root.is_dir():
            return []
        out = []
        for folder, dirs, files in os.walk(root, followlinks=False):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                path = Path(folder) / name
                info = path.lstat()
                if name.startswith(".") or not stat.S_ISREG(info.st_mode):
                    continue
                rel = path.relative_to(root).as_posix()
                out.append(
                    Artifact(path=rel, size=info.st_size, url=f"{base_url}/v1/jobs/{job_id}/artifacts/{rel}")
                )
        return sorted(out, key=lambda a: a.path)

    def artifact_path(self, root: Path, job_id: str, rel: str) -> Path:
        """The file `rel` names under the run dir: a regular file inside it, reached without links.

        Every refusal (absolute, `..`, link, special file, missing) is the same 404, so an
        answer tells nothing about what exists outside the run dir.
        """
        try:
            return file_inside(root, rel)
        except UnsafePath:
            raise ApiError(404, f"no artifact {rel[:200]!r} for job {job_id}", field="path") from None

    def adapters(self) -> list[AdapterView]:
        root = Path(self.settings.adapter_dir)
        out = []
        if root.exists():
            for job_dir in sorted(p for p in root.iterdir() if p.is_dir()):
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
