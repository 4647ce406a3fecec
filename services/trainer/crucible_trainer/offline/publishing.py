"""Serving saved adapters through the job's `Publisher` (each version a new `<job>-v<N>` name).

The online loop publishes its live policy; offline stages publish adapters that are files:
`SavedAdapter` is the policy-like object `Publisher.publish` asks to save itself into the
adapter store. `AdapterServer` remembers what it has loaded, so a stage asking for an adapter
the generators already serve gets its name back; a name re-used for other weights (a stage run
again in the same job) is unloaded first, so no replica keeps serving stale weights under it.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from crucible_trainer.offline.artifacts import content_hash
from crucible_trainer.rl.publish import Publisher
from crucible_trainer.runtime.atomic import output_dir


@dataclass
class SavedAdapter:
    path: Path

    async def call(self, fn: Callable[..., Path], *args: object) -> Path:
        """As `Policy.call`; a copy of files needs no thread of its own."""
        return await asyncio.to_thread(fn, *args)

    def save_adapter(self, dest: Path, gate: Callable[[], None] | None = None) -> Path:
        with output_dir(dest) as tmp:
            shutil.copytree(self.path, tmp, dirs_exist_ok=True)
            if gate is not None:
                gate()  # the run's lease, checked before the copy becomes `dest`
        return dest


@dataclass
class AdapterServer:
    publisher: Publisher
    loaded: dict[int, str] = field(default_factory=dict)  # version -> content hash of what it serves

    def name(self, version: int) -> str:
        return self.publisher.name(version)

    async def serve(self, adapter: Path | None, version: int) -> tuple[str, dict[str, float] | None]:
        """The model name that serves `adapter` (None: the base model), and the publish timings
        when it had to be loaded."""
        if adapter is None:
            return self.publisher.base_name, None
        name, digest = self.name(version), content_hash(adapter)
        if self.loaded.get(version) == digest and name in self.publisher.live:
            return name, None
        await self.publisher.pool.unload_adapter(name, missing_ok=True)
        if name in self.publisher.live:
            self.publisher.live.remove(name)
        timings = await self.publisher.publish(SavedAdapter(adapter), version)  # type: ignore[arg-type]
        self.loaded[version] = digest
        return name, timings
