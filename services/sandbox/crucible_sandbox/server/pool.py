"""A pool of worker processes (each with its zygote), one per slot, driven from the server's event loop.

Each worker serves one run at a time. Slots come in two kinds:

* **batch slots** (`batch_slots` of them): the only ones batch runs use. Their worker, zygote
  and run processes run at niceness `batch_nice` under the scheduling policy `batch_policy`
  (normal priority by default: limits are wall-clock, and on a shared host deprioritised runs
  would be starved into timeouts; a dedicated host can set `SCHED_IDLE` so that a single run,
  and the server, get the CPU at once while a batch keeps every core busy);
* **interactive slots** (the rest): kept for single runs, so one submitted during a large batch
  waits for neither the batch nor the CPU.

A single run takes an idle interactive slot, else any idle slot, else waits for one to come free.
Waiting runs queue per tenant, and a freed slot goes to the head of the queue of the tenant served
least recently (round robin over tenants): however many runs one tenant has queued, another
tenant's run waits for at most one slot to come free. Within a tenant, runs are served in arrival
order. A worker that dies is restarted and its run is answered with `sandbox_error`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import sys
from collections import deque
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
        # Runs waiting for a slot, per tenant: (wants a batch slot, the future the slot is given to).
        self.waiting: dict[str, deque[tuple[bool, asyncio.Future[Worker]]]] = {}
        self.served: dict[str, int] = {}  # tenant -> tick of its last slot (round robin order)
        self.tick = 0
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

    async def _acquire(self, batch: bool, tenant: str) -> Worker:
        # An idle interactive slot means no single run waits (a freed slot goes to a waiter first),
        # and batch runs cannot take it; with no one waiting, any idle slot may be taken.
        worker = None
        if not batch and self.idle_interactive:
            worker = self.idle_interactive.pop()
        elif not self.waiting:
            worker = self._take(batch)
        if worker is not None:
            self._served(tenant)
            return worker
        future: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        queue = self.waiting.setdefault(tenant, deque())
        entry = (batch, future)
        queue.append(entry)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # given a slot just as the caller left
                await self._release(future.result())
            raise
        finally:
            if entry in queue:
                queue.remove(entry)
            if not queue and self.waiting.get(tenant) is queue:
                del self.waiting[tenant]

    def _served(self, tenant: str) -> None:
        self.tick += 1
        self.served[tenant] = self.tick

    async def _release(self, worker: Worker) -> None:
        """Give the freed slot to the next waiting run (round robin over tenants), else idle it."""
        is_batch_slot = worker.slot < self.batch_slots
        for tenant in sorted(self.waiting, key=lambda t: self.served.get(t, 0)):
            queue = self.waiting[tenant]
            # A batch run takes only batch slots; a single run takes any slot.
            for entry in queue:
                wants_batch, future = entry
                if future.done() or (wants_batch and not is_batch_slot):
                    continue
                queue.remove(entry)
                if not queue:
                    del self.waiting[tenant]
                self._served(tenant)
                future.set_result(worker)
                return
        self._idle_list(worker).append(worker)

    async def run(self, request: PreparedRun, batch: bool = False, tenant: str = "") -> RunResultData:
        worker = await self._acquire(batch, tenant)
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
