"""`JobRun` owns a job's services: the generator pool and the sandbox open on first use and close
when the run ends, however it ends, after the runner's own `close` (which may still unload
adapters through the pool); a run that never touches them never opens them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from crucible_shared.jobs import EvalJob, PipelineJob
from crucible_trainer.runtime import jobrun
from crucible_trainer.runtime.channel import LocalChannel
from crucible_trainer.runtime.jobrun import JobRun
from crucible_trainer.runtime.runners import runner_for
from crucible_trainer.settings import Settings

from tests.runner_specs import KINDS, small_job


class Service:
    """Stands in for a `GeneratorPool` or `SandboxClient`: records that it opened and closed."""

    opened: list[Service] = []

    def __init__(self, kind: str, fail_close: bool = False) -> None:
        self.kind, self.closed, self.fail_close = kind, False, fail_close
        Service.opened.append(self)

    async def aclose(self) -> None:
        self.closed = True
        if self.fail_close:
            raise ConnectionError(f"{self.kind} would not close")

    close = aclose

    async def wait_ready(self, timeout: float = 0.0) -> None:
        await asyncio.sleep(3600)  # never ready: the cancel ends the wait


@pytest.fixture
def services(monkeypatch) -> list[Service]:
    Service.opened = []

    class Pool:
        @staticmethod
        def from_urls(urls: Any) -> Service:
            return Service("pool")

    monkeypatch.setattr(jobrun, "GeneratorPool", Pool)
    monkeypatch.setattr(jobrun, "SandboxClient", lambda url, api_key=None, **kw: Service("sandbox"))
    return Service.opened


def settings(tmp_path: Path) -> Settings:
    return Settings(
        generator_urls=["http://127.0.0.1:9"],
        sandbox_url="http://127.0.0.1:9",
        runs_dir=tmp_path / "jobs",
        cancel_poll_s=0.01,
    )


class Probe(JobRun):
    """A runner whose body touches the services named by `uses`, then ends as `outcome` says."""

    loads_model = False
    uses: tuple[str, ...] = ("pool", "sandbox")
    outcome = "finish"
    open_in_close: bool | None = None  # whether the pool was still open when close() ran

    async def body(self) -> None:
        for name in self.uses:
            getattr(self, name)
        if self.outcome == "cancel":
            await self.cancel.guard(asyncio.sleep(30))
        if self.outcome == "raise":
            raise RuntimeError("the body failed")

    async def close(self) -> None:
        if "pool" in self.uses:
            self.open_in_close = not self.pool.closed  # type: ignore[attr-defined]
        if self.outcome == "close raises":
            raise RuntimeError("close failed")


def play(run: JobRun) -> tuple[dict[str, Any] | None, BaseException | None]:
    try:
        return asyncio.run(run.run()), None
    except Exception as exc:
        return None, exc


@pytest.mark.parametrize("outcome", ["finish", "cancel", "raise", "close raises"])
def test_services_close_whatever_happened(outcome, services, tmp_path) -> None:
    channel = LocalChannel("job-1")
    if outcome == "cancel":
        channel.cancel()
    run = Probe(EvalJob(), "job-1", settings(tmp_path), channel)
    run.outcome = outcome
    summary, error = play(run)
    assert [s.kind for s in services] == ["pool", "sandbox"]
    assert all(s.closed for s in services)
    assert run.open_in_close is True  # the runner released what it holds through an open pool
    if outcome in ("finish", "cancel"):
        assert (
            summary is not None
            and summary["status"] == {"finish": "finished", "cancel": "cancelled"}[outcome]
        )
    else:
        assert isinstance(error, RuntimeError)
    assert (tmp_path / "jobs" / "job-1" / "summary.json").exists()


def test_sandbox_closes_when_the_pool_will_not(services, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(jobrun.GeneratorPool, "from_urls", staticmethod(lambda urls: Service("pool", True)))
    _, error = play(Probe(EvalJob(), "job-1", settings(tmp_path), LocalChannel("job-1")))
    assert isinstance(error, ConnectionError)
    assert [(s.kind, s.closed) for s in services] == [("pool", True), ("sandbox", True)]


def test_a_run_opens_only_what_it_uses(services, tmp_path) -> None:
    run = Probe(EvalJob(), "job-1", settings(tmp_path), LocalChannel("job-1"))
    run.uses = ("sandbox",)
    summary, _ = play(run)
    assert summary is not None and summary["status"] == "finished"
    assert [(s.kind, s.closed) for s in services] == [("sandbox", True)]

    run = Probe(EvalJob(), "job-2", settings(tmp_path), LocalChannel("job-2"))
    run.uses = ()
    summary, _ = play(run)
    assert summary is not None and summary["status"] == "finished"
    assert len(services) == 1  # nothing more opened


def test_a_pipeline_stage_without_services_opens_none(services, tmp_path, monkeypatch) -> None:
    """`build` reads files only: its missing input stops the job before anything connects."""
    monkeypatch.setenv("CRUCIBLE_DATA_ROOTS", str(tmp_path))
    spec = PipelineJob.model_validate({"stages": ["build"], "logging": {"wandb_mode": "disabled"}})
    _, error = play(runner_for(spec)(spec, "job-1", settings(tmp_path), LocalChannel("job-1")))
    assert error is not None and "annotate" in str(error)
    assert services == []


@pytest.mark.parametrize("kind", KINDS)
def test_real_runners_close_what_they_opened(kind, services, tmp_path, monkeypatch) -> None:
    spec = small_job(kind, tmp_path, monkeypatch)
    channel = LocalChannel("job-1")
    channel.cancel()
    summary, error = play(runner_for(spec)(spec, "job-1", settings(tmp_path), channel))
    assert error is None and summary is not None and summary["status"] == "cancelled"
    assert all(s.closed for s in services)
