"""Gateway logic, independent of HTTP: submit, view, list, cancel, retry, artifacts, adapters."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from crucible_shared.http import ApiError
from crucible_shared.jobs import EvalJob, TrainJob

from crucible_gateway.protocol import FINAL, AdapterView, Artifact, JobStatus, JobView
from crucible_gateway.settings import Settings
from crucible_gateway.store import JobStore


class GatewayService:
    def __init__(self, settings: Settings, store: JobStore) -> None:
        self.settings, self.store = settings, store

    def submit(self, spec: TrainJob | EvalJob, idempotency_key: str | None) -> tuple[str, bool]:
        return self.store.submit(spec.kind, spec.model_dump(mode="json"), spec.name, idempotency_key)

    def view(self, job_id: str, with_spec: bool = True) -> JobView:
        record = self.store.get(job_id)
        if record is None:
            raise ApiError(404, f"no job {job_id!r}", field="job_id")
        record = self._reconcile(record)
        data = {k: v for k, v in record.items() if k in JobView.model_fields}
        if not with_spec:
            data.pop("spec", None)
        data["name"] = data.get("name") or None
        data["error"] = data.get("error") or None
        for key in ("started_at", "finished_at"):
            if not isinstance(data.get(key), int | float):
                data[key] = None
        return JobView.model_validate(data)

    def _reconcile(self, record: dict[str, Any]) -> dict[str, Any]:
        """A running job whose worker went silent is failed, never "running" forever."""
        status = record.get("status")
        if status == "running":
            beat = record.get("heartbeat_at") or record.get("started_at") or record.get("created_at")
            if isinstance(beat, int | float) and time.time() - beat > self.settings.heartbeat_timeout_s:
                step = record.get("step")
                where = f" at step {step}" if step not in (None, "") else ""
                error = (
                    f"the worker stopped reporting{where} (killed or crashed); "
                    f"POST /v1/jobs/{record['id']}/retry resumes from the last checkpoint"
                )
                self.store.update(record["id"], status="failed", error=error, finished_at=time.time())
                record.update(status="failed", error=error)
        elif status == "queued":
            rq = self.store.rq_status(record["id"])
            if rq in ("failed", "stopped"):
                error = "the job failed before it started (see the worker log)"
                self.store.update(record["id"], status="failed", error=error, finished_at=time.time())
                record.update(status="failed", error=error)
        return record

    def list(
        self, status: JobStatus | None, kind: str | None, offset: int, limit: int
    ) -> tuple[list[JobView], int]:
        if status is None and kind is None:
            ids, total = self.store.list_ids(offset, limit)
            return [self.view(i, with_spec=False) for i in ids], total
        matching = []
        for job_id in self.store.all_ids():
            view = self.view(job_id, with_spec=False)
            if (status is None or view.status == status) and (kind is None or view.kind == kind):
                matching.append(view)
        return matching[offset : offset + limit], len(matching)

    def cancel(self, job_id: str) -> JobView:
        view = self.view(job_id)
        if view.status in FINAL:
            raise ApiError(409, f"job {job_id} already {view.status.value}", field="job_id", code="conflict")
        self.store.request_cancel(job_id)
        if view.status == JobStatus.queued and self.store.cancel_queued(job_id):
            self.store.update(job_id, status="cancelled", finished_at=time.time())
        return self.view(job_id)

    def retry(self, job_id: str) -> JobView:
        view = self.view(job_id)
        if view.status not in (JobStatus.failed, JobStatus.cancelled):
            raise ApiError(
                409,
                f"only failed or cancelled jobs can be retried; {job_id} is {view.status.value}",
                field="job_id",
            )
        record = self.store.get(job_id)
        assert record is not None
        self.store.retry(job_id, record)
        return self.view(job_id)

    # -- files ------------------------------------------------------------------------------------
    def run_dir(self, job_id: str) -> Path:
        self.view(job_id, with_spec=False)
        return Path(self.settings.runs_dir) / job_id

    def artifacts(self, job_id: str, base_url: str) -> list[Artifact]:
        root = self.run_dir(job_id)
        if not root.exists():
            return []
        out = []
        for path in sorted(
            p
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        ):
            rel = path.relative_to(root).as_posix()
            out.append(
                Artifact(
                    path=rel, size=path.stat().st_size, url=f"{base_url}/v1/jobs/{job_id}/artifacts/{rel}"
                )
            )
        return out

    def artifact_path(self, job_id: str, rel: str) -> Path:
        root = self.run_dir(job_id).resolve()
        target = (root / rel).resolve()
        if root not in target.parents or not target.is_file():
            raise ApiError(404, f"no artifact {rel!r} for job {job_id}", field="path")
        return target

    def adapters(self) -> list[AdapterView]:
        root = Path(self.settings.adapter_dir)
        out = []
        if root.exists():
            for job_dir in sorted(p for p in root.iterdir() if p.is_dir()):
                for version_dir in sorted(job_dir.glob("v*")):
                    suffix = version_dir.name[1:]
                    if suffix.isdigit() and (version_dir / "adapter_config.json").exists():
                        out.append(
                            AdapterView(
                                name=f"{job_dir.name}-v{suffix}",
                                job_id=job_dir.name,
                                version=int(suffix),
                                path=str(version_dir),
                            )
                        )
        return out
