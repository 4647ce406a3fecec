"""A pool of worker processes (each with its zygote), one per slot, driven from the server's event loop.

Each worker serves one run at a time. Runs wait for a free worker in FIFO order; a batch
holds at most `batch_concurrency` slots at once, so a single run submitted during a large
batch waits for about one run, not for the whole batch. A worker that dies is restarted and
its run is answered with `sandbox_error`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import sys
from typing import Any

from crucible_sandbox.channel import encode_frame

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">I")


class Worker:
    def __init__(self, slot: int, config: dict[str, Any]) -> None:
        self.slot, self.config = slot, config
        self.proc: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}

    async def start(self) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        # Workers and zygotes import exactly what the server imports, installed or not (nothing
        # secret here); the server's own environment, with its secrets, is not passed on.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "crucible_sandbox.worker",
            json.dumps({**self.config, "slot": self.slot}),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 26,
        )
        self.info = await self._read()

    async def _read(self) -> dict[str, Any]:
        assert self.proc and self.proc.stdout
        header = await self.proc.stdout.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        return json.loads(await self.proc.stdout.readexactly(size))

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write(encode_frame(request))
        await self.proc.stdin.drain()
        return await self._read()

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
    def __init__(self, workers: int, config: dict[str, Any]) -> None:
        self.size, self.config = workers, config
        self.idle: asyncio.Queue[Worker] = asyncio.Queue()
        self.workers: list[Worker] = []
        self.pending = 0  # runs admitted and not finished
        self.restarts = 0

    async def start(self) -> None:
        self.workers = [Worker(i, self.config) for i in range(self.size)]
        await asyncio.gather(*(w.start() for w in self.workers))
        for w in self.workers:
            self.idle.put_nowait(w)

    @property
    def isolation(self) -> dict[str, Any]:
        return self.workers[0].info if self.workers else {}

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        worker = await self.idle.get()
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
            self.idle.put_nowait(worker)

    async def _restart(self, worker: Worker) -> None:
        if worker.proc and worker.proc.returncode is None:
            worker.proc.kill()
            await worker.proc.wait()
        await worker.start()
