"""A pool of worker processes (each with its zygote), one per slot, driven from the server's event loop.

Each worker serves one run at a time. Slots come in two kinds:

* **batch slots** (`batch_slots` of them): the only ones batch runs use. Their worker, zygote
  and run processes run at niceness `batch_nice` under the scheduling policy `batch_policy`
  (normal priority by default: limits are wall-clock, and on a shared host deprioritised runs
  would be starved into timeouts; a dedicated host can set `SCHED_IDLE` so that a single run,
  and the server, get the CPU at once while a batch keeps every core busy);
* **interactive slots** (the rest): kept for single runs, so one submitted during a large batch
  waits for neither the batch nor the CPU.

A single run takes an idle interactive slot, else any idle slot, else waits (FIFO) for the first
one to come free. A worker that dies is restarted and its run is answered with `sandbox_error`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import sys
from typing import Any, cast

from crucible_sandbox.wire.channel import encode_frame
from crucible_sandbox.wire.messages import IsolationSettings, PreparedRun, RunResultData, SlotConfig, SlotInfo

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">I")


class Worker:
    def __init__(self, slot: int, config: IsolationSettings, nice: int = 0, policy: str = "other") -> None:
        self.slot, self.config, self.nice, self.policy = slot, config, nice, policy
        self.proc: asyncio.subprocess.Process | None = None
        self.info: SlotInfo | None = None

    async def start(self) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        # Workers and zygotes import exactly what the server imports, installed or not (nothing
        # secret here); the server's own environment, with its secrets, is not passed on.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        config: SlotConfig = {**self.config, "slot": self.slot, "owner": os.getpid()}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "crucible_sandbox.judging.worker",
            json.dumps(config),
            str(self.nice),
            self.policy,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 26,
        )
        self.info = cast(SlotInfo, await self._read())

    async def _read(self) -> Any:
        assert self.proc and self.proc.stdout
        header = await self.proc.stdout.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        return json.loads(await self.proc.stdout.readexactly(size))

    async def run(self, request: PreparedRun) -> RunResultData:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write(encode_frame(request))
        await self.proc.stdin.drain()
        return cast(RunResultData, await self._read())

    async def stop(self) -> None:
        if self.proc and self.proc.returncode is None:
            try:
                assert self.proc.stdin
                self.proc.stdin.close()
                await asyncio.wait_for(self.proc.wait(), 2)
            except (TimeoutError, ConnectionError, RuntimeError):
                self.proc.kill()
                await self.proc.wait()


class WorkerPool:
    def __init__(
        self,
        workers: int,
        config: IsolationSettings,
        batch_slots: int,
        batch_nice: int = 0,
        batch_policy: str = "other",
    ) -> None:
        self.size, self.config = workers, config
        self.batch_slots, self.batch_nice, self.batch_policy = (
            min(batch_slots, workers),
            batch_nice,
            batch_policy,
        )
        self.workers: list[Worker] = []
        self.idle_batch: list[Worker] = []
        self.idle_interactive: list[Worker] = []
        self.freed = asyncio.Condition()
        self.pending = 0  # runs admitted and not finished
        self.restarts = 0

    async def start(self) -> None:
        self.workers = [
            Worker(i, self.config, nice=self.batch_nice, policy=self.batch_policy)
            if i < self.batch_slots
            else Worker(i, self.config)
            for i in range(self.size)
        ]
        await asyncio.gather(*(w.start() for w in self.workers))
        for w in self.workers:
            self._idle_list(w).append(w)

    @property
    def isolation(self) -> SlotInfo | None:
        """What the first slot's zygote set up (None before the pool started)."""
        return self.workers[0].info if self.workers else None

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)

    def _idle_list(self, worker: Worker) -> list[Worker]:
        return self.idle_batch if worker.slot < self.batch_slots else self.idle_interactive

    def _take(self, batch: bool) -> Worker | None:
        if batch:
            return self.idle_batch.pop() if self.idle_batch else None
        for idle in (self.idle_interactive, self.idle_batch):
            if idle:
                return idle.pop()
        return None

    async def _acquire(self, batch: bool) -> Worker:
        worker = self._take(batch)
        if worker is not None:
            return worker
        async with self.freed:  # waiters are woken in arrival order
            while (worker := self._take(batch)) is None:
                await self.freed.wait()
        return worker

    async def _release(self, worker: Worker) -> None:
        self._idle_list(worker).append(worker)
        async with self.freed:
            self.freed.notify_all()

    async def run(self, request: PreparedRun, batch: bool = False) -> RunResultData:
        worker = await self._acquire(batch)
        try:
            return await worker.run(request)
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError, json.JSONDecodeError) as exc:
            log.warning("worker %d failed (%r); restarting it", worker.slot, exc)
            self.restarts += 1
            await self._restart(worker)
            return {
                "status": "sandbox_error",
                "passed": 0,
                "total": 0,
                "message": "sandbox worker crashed; retry the run",
            }
        except asyncio.CancelledError:
            # The client went away mid-run: the worker's answer would be read by the next run.
            await self._restart(worker)
            raise
        finally:
            await self._release(worker)

    async def _restart(self, worker: Worker) -> None:
        if worker.proc and worker.proc.returncode is None:
            worker.proc.kill()
            await worker.proc.wait()
        await worker.start()
