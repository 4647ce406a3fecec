"""An offline job's services made ready on first use, and its adapters served to the generators.

Offline jobs talk to the services only in some stages (a pipeline running `build` and `train`
needs neither), so nothing waits on them until a stage asks: `pool` and `sandbox` wait for the
run's own connections (`JobRun.pool` / `.sandbox`, which the run opens on first use and closes).
`serve` hot-swaps a saved adapter into every generator replica (`publishing.AdapterServer`);
`evaluate` is the one evaluation code path (`evaluation.job.evaluate_spec`) writing a report folder;
`retire_adapters` unloads the job's adapters.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from crucible_shared.generator_client import GeneratorPool
from crucible_shared.jobs import EvalSpec
from crucible_shared.sandbox_client import SandboxClient

from crucible_trainer.evaluation.job import evaluate_spec, served_base
from crucible_trainer.offline.publishing import AdapterServer
from crucible_trainer.rl.publish import Publisher
from crucible_trainer.runtime.jobrun import JobRun

log = logging.getLogger(__name__)


class JobServices:
    def __init__(self, run: JobRun, base: str) -> None:
        self.run, self.base = run, base
        self.cancel, self.events = run.cancel, run.events
        self._server: AdapterServer | None = None
        self._sandbox_ready = False

    async def pool(self) -> GeneratorPool:
        pool = self.run.pool
        if self._server is None:
            await self.cancel.guard(pool.wait_ready(timeout=600))
            base_name = await served_base(pool, self.base)
            adapters = Path(self.run.settings.adapter_dir)
            self._server = AdapterServer(
                Publisher(pool, adapters, self.run.job_id, 1, base_name, channel=self.run.channel)
            )
        return pool

    async def sandbox(self) -> SandboxClient:
        sandbox = self.run.sandbox
        if not self._sandbox_ready:
            await self.cancel.guard(sandbox.wait_ready(timeout=120))
            self._sandbox_ready = True
        return sandbox

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
        """Evaluate `model` on `spec` into the folder `out` (replaced by a new folder: never
        written into files hard-linked from a reused run); returns the report."""
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

    async def retire_adapters(self) -> None:
        """Unload the job's adapters, freeing the generators' slots (before the pool closes)."""
        if self._server is not None:
            try:
                await self._server.publisher.retire_all()
            except Exception as exc:
                log.warning("could not unload %s's adapters: %r", self.run.job_id, exc)
