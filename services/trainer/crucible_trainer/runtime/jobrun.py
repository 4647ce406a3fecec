"""`JobRun`: what every job run shares, written once under the four runners (`online.train.TrainRun`,
`offline.job.OfflineTrainRun`, `offline.pipeline.PipelineRun`, `evaluation.job.EvalRun`).

The base owns the run directory (`runs/<job id>`, the checked spec in `spec.json`, the summary in
`summary.json`), the cancel token, the event sink, W&B, the services and the summary. `run()` is
the same for every job:

    paths checked, local models snapshotted -> prepare() -> spec.json -> status starting -> setup() -> W&B -> body()
    -> finished (status event with the summary) | cancelled (status event) | the error raised
    and in every case: the cancel poller stopped, close() (what the runner holds), the services
    closed, W&B finished, summary.json written.

What the run loads from disk is what was checked: a local `model.base` (a job that loads its
model) and `model.init_adapter` are copied, through the descriptors the containment check opened,
into private snapshots (`crucible_shared.snapshot`) that the loaders are given
(`loaded_model()`), removed when the run ends; the spec keeps the names the job gave.

The services are the generator replicas (`pool`) and the sandbox (`sandbox`) the settings name,
each connected on first use: a runner that never touches one (a pipeline running only `build`
and `train`, a run that fails or is cancelled before its body) never opens it.

A runner fills in `body` (its work) and, where it needs them, `prepare` (before anything is
written: load a data file, copy a reused run dir), `starting` (the starting event's fields),
`setup` (after the starting event, before W&B: resolve the hardware, load the policy) and `close`
(unload its generator adapters: it runs before the services close). The summary is a dict while
the job runs and is returned as `crucible_shared.lifecycle.JobSummary` validates it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from crucible_shared.generator_client import GeneratorPool
from crucible_shared.jobs import ModelSpec, job_paths
from crucible_shared.lifecycle import JobStatus, JobSummary
from crucible_shared.paths import PathMissing, PathOutsideRoots, PathRoots, with_checked_paths
from crucible_shared.sandbox_client import SandboxClient
from crucible_shared.snapshot import SnapshotRefused, snapshot_inside

from crucible_trainer.runtime.cancel import Cancelled, CancelToken
from crucible_trainer.runtime.channel import JobChannel
from crucible_trainer.runtime.sink import EventSink, start_wandb
from crucible_trainer.settings import Settings

MODEL_FIELDS = frozenset({"model.base", "model.init_adapter"})


def take_snapshots(
    spec: Any, roots: PathRoots, fields: Iterable[str] = MODEL_FIELDS, into: Path | None = None
) -> dict[str, Path]:
    """Spec field -> a private snapshot, in `into` (default the temp dir), of the local directory it
    names (of `fields`; a hub name is no path and has none), read through the descriptor of the
    containment check. The caller drops them (`drop_snapshots`). A link or a special file in the
    directory is `PathOutsideRoots`."""
    wanted, loaded = set(fields), {}
    try:
        for field, value, kind in job_paths(spec):
            if field not in wanted:
                continue
            try:
                loaded[field] = snapshot_inside(
                    field, value, roots.of(kind), kind, prefix=f"crucible-{kind}-", into=into
                )
            except SnapshotRefused as exc:
                raise PathOutsideRoots(field, f"{value}: {exc.entry} {exc.reason}") from None
            except NotADirectoryError:
                raise PathMissing(field, f"{value} is not a directory") from None
    except BaseException:
        drop_snapshots(loaded)
        raise
    return loaded


def drop_snapshots(loaded: dict[str, Path]) -> None:
    for path in loaded.values():
        shutil.rmtree(path, ignore_errors=True)


def loaded_model(model: ModelSpec, loaded: dict[str, Path]) -> ModelSpec:
    """`model` with each field of `loaded` naming its snapshot."""
    return model.model_copy(
        update={field.removeprefix("model."): str(path) for field, path in loaded.items()}
    )


class JobRun:
    """One job run: `await Runner(spec, job_id, settings, channel).run()` -> its summary."""

    # Whether the job loads `model.base` itself (train jobs) rather than asking the generator
    # for it by name (eval jobs): then the spec carries the checked absolute path.
    loads_model: ClassVar[bool] = True

    def __init__(self, spec: Any, job_id: str, settings: Settings, channel: JobChannel) -> None:
        self.spec, self.job_id, self.settings, self.channel = spec, job_id, settings, channel
        self.run_dir = Path(settings.runs_dir) / job_id
        self.cancel = CancelToken(channel, settings.cancel_poll_s)
        self.events = EventSink(channel, self.run_dir)
        self.paths: dict[str, Path] = {}
        self.loaded: dict[str, Path] = {}  # spec field -> the private snapshot the loaders read
        self.summary: dict[str, Any] = {"job_id": job_id, "run_dir": str(self.run_dir)}
        self._pool: GeneratorPool | None = None
        self._sandbox: SandboxClient | None = None

    # -- the services, opened on first use and closed by `run()` ---------------------------------
    @property
    def pool(self) -> GeneratorPool:
        """The generator replicas of `settings.generator_urls`."""
        if self._pool is None:
            self._pool = GeneratorPool.from_urls(self.settings.generator_urls)
        return self._pool

    @property
    def sandbox(self) -> SandboxClient:
        """The sandbox of `settings.sandbox_url`."""
        if self._sandbox is None:
            # Streamed rollouts send small batches as completions finish; one holding a program that
            # runs to its limit must not hold back the rest (the sandbox enforces each tenant's share).
            self._sandbox = SandboxClient(
                self.settings.sandbox_url, api_key=self.settings.sandbox_api_key, max_concurrency=16
            )
        return self._sandbox

    async def close_services(self) -> None:
        """Close the services this run opened (each one, even if closing the other fails)."""
        pool, sandbox, self._pool, self._sandbox = self._pool, self._sandbox, None, None
        try:
            if pool is not None:
                await pool.aclose()
        finally:
            if sandbox is not None:
                await sandbox.close()

    # -- what is loaded from disk -------------------------------------------------------------
    def loaded_model(self) -> ModelSpec:
        """`spec.model` as the loaders take it: a local `base` or `init_adapter` names the run's
        snapshot of the checked directory, never the path again."""
        return loaded_model(self.spec.model, self.loaded)

    def _snapshot(self, roots: PathRoots) -> None:
        fields = {"model.init_adapter", *(("model.base",) if self.loads_model else ())}
        self.loaded = take_snapshots(self.spec, roots, fields, self.settings.snapshot_dir)

    def _drop_snapshots(self) -> None:
        drop_snapshots(self.loaded)

    # -- what a runner fills in -------------------------------------------------------------------
    async def prepare(self) -> None:
        """Before spec.json and the starting event (checks that need no services)."""

    def starting(self) -> dict[str, Any]:
        """Fields of the `starting` status event."""
        return {}

    async def setup(self) -> None:
        """After the starting event, before W&B starts."""

    async def body(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the runner holds, e.g. its generator adapters (called whatever happened,
        before the services close)."""

    # -- the run ----------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        roots = self.settings.path_roots()
        self.paths = roots.check(self.spec, real=True)
        # The job reads what was checked; an eval keeps model.base, the name its generator serves.
        checked = {f: p for f, p in roots.check(self.spec).items() if self.loads_model or f != "model.base"}
        self.spec = with_checked_paths(self.spec, checked)
        try:
            await asyncio.to_thread(self._snapshot, roots)
            return await self._run()
        finally:
            await asyncio.to_thread(self._drop_snapshots)

    async def _run(self) -> dict[str, Any]:
        await self.prepare()
        self.channel.gate()
        (self.run_dir / "spec.json").write_text(self.spec.model_dump_json(indent=2))
        self.cancel.start()
        try:
            self.events.emit("status", status="starting", **self.starting())
            await self.setup()
            self._start_wandb()
            await self.body()
            self.summary["status"] = JobStatus.finished.value
        except Cancelled:
            self.summary["status"] = JobStatus.cancelled.value
            self.events.emit("status", status="cancelled")
        finally:
            self.cancel.stop()
            try:
                try:
                    await self.close()
                finally:
                    await self.close_services()
            finally:
                if self.events.wandb_run is not None:
                    self.events.wandb_run.finish()
                if not self.channel.superseded():  # the run holding the job writes its summary
                    self.channel.gate()
                    self.write_summary()
        if self.summary["status"] == JobStatus.finished.value:
            self.events.emit("status", status="finished", summary=self.summary)
        return self.summary

    def _start_wandb(self) -> None:
        logging_ = getattr(self.spec, "logging", None)
        if logging_ is None:  # eval jobs log to their report only
            return
        self.events.wandb_run = start_wandb(
            self.job_id,
            logging_.wandb_mode,
            logging_.wandb_project,
            logging_.run_name,
            self.run_dir,
            self.spec.model_dump(mode="json"),
            tag=self.channel.tag,
        )
        if self.events.wandb_run is not None:
            self.summary["wandb_run"] = self.events.wandb_run.id

    def write_summary(self) -> None:
        """summary.json, and the summary itself made JSON-ready through `JobSummary`."""
        self.summary = JobSummary.model_validate(self.summary).model_dump(mode="json", exclude_none=True)
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str))
