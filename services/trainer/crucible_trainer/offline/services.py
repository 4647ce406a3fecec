"""The generator pool, sandbox and adapter server of an offline job, connected on first use.

Offline jobs talk to the services only in some stages (a pipeline running `build` and `train`
needs neither), so nothing connects until a stage asks. `serve` hot-swaps a saved adapter into
every generator replica (`publishing.AdapterServer`); `evaluate` is the one evaluation code path
(`evaljob.evaluate_spec`) writing a report folder; `close` unloads the job's adapters.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from crucible_shared.generator_client import GeneratorPool
from crucible_shared.jobs import EvalSpec
from crucible_shared.sandbox_client import SandboxClient

from crucible_trainer.cancel import CancelToken
from crucible_trainer.evaljob import evaluate_spec, served_base
from crucible_trainer.events import EventSink
from crucible_trainer.offline.publishing import AdapterServer
from crucible_trainer.publish import Publisher
from crucible_trainer.settings import Settings

log = logging.getLogger(__name__)


class JobServices:
    def __init__(
        self, settings: Settings, job_id: str, base: str, cancel: CancelToken, events: EventSink
    ) -> None:
        self.settings, self.job_id, self.base = settings, job_id, base
        self.cancel, self.events = cancel, events
        self._pool: GeneratorPool | None = None
        self._sandbox: SandboxClient | None = None
        self._server: AdapterServer | None = None
        self._sandbox_ready = False

    async def pool(self) -> GeneratorPool:
        if self._pool is None:
            self._pool = GeneratorPool.from_urls(self.settings.generator_urls)
            await self.cancel.guard(self._pool.wait_ready(timeout=600))
            base_name = await served_base(self._pool, self.base)
            publisher = Publisher(self._pool, Path(self.settings.adapter_dir), self.job_id, 1, base_name)
            self._server = AdapterServer(publisher)
        return self._pool

    async def sandbox(self) -> SandboxClient:
        if self._sandbox is None:
            self._sandbox = SandboxClient(self.settings.sandbox_url, api_key=self.settings.sandbox_api_key)
        if not self._sandbox_ready:
            await self.cancel.guard(self._sandbox.wait_ready(timeout=120))
            self._sandbox_ready = True
        return self._sandbox

    @property
    def model_name(self) -> str:
        """What the generators serve for this job now (its newest adapter, or the base)."""
        return self._server.publisher.model_name if self._server else ""

    async def serve(self, adapter: Path | None, version: int) -> str:
        """The generators' name for the policy `adapter` (None: the base), loaded if needed."""
        await self.pool()
        assert self._server is not None
        name, timings = await self.cancel.guard(self._server.serve(adapter, version))
        if timings is not None:
            self.events.emit("adapter_published", step=version, name=name, load_s=timings["publish/load_s"])
        return name

    async def evaluate(
        self, spec: EvalSpec, out: Path, *, model: str, chat: bool, seed: int, label: str, step: int
    ) -> Any:
        """Evaluate `model` on `spec` into the folder `out` (replaced: never written into files
        hard-linked from a reused run); returns the report."""
        if out.exists():
            shutil.rmtree(out)
        report, headline = await evaluate_spec(
            spec,
            await self.pool(),
            await self.sandbox(),
            model=model,
            chat=chat,
            seed=seed,
            out=out,
            cancel=self.cancel,
            events=self.events,
            label=label,
        )
        self.events.eval_point(step, label, headline)
        return report

    async def close(self) -> None:
        if self._server is not None:
            try:
                await self._server.publisher.retire_all()  # free the generators' adapter slots
            except Exception as exc:
                log.warning("could not unload %s's adapters: %r", self.job_id, exc)
        if self._pool is not None:
            await self._pool.aclose()
        if self._sandbox is not None:
            await self._sandbox.close()
