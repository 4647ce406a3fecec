"""A pool of zygote processes, one per worker slot, driven from the server's event loop.

Each zygote serves one run at a time. Runs wait for a free zygote in FIFO order; a batch
holds at most `batch_concurrency` slots at once, so a single run submitted during a large
batch waits for about one run, not for the whole batch. A zygote that dies is restarted and
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


class Zygote:
    def __init__(self, slot: int, config: dict[str, Any]) -> None:
        self.slot, self.config = slot, config
        self.proc: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}

    async def start(self) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        # The zygote imports exactly what the server imports, installed or not (nothing secret here).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "crucible_sandbox.zygote",
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


class ZygotePool:
    def __init__(self, workers: int, config: dict[str, Any]) -> None:
        self.size, self.config = workers, config
        self.idle: asyncio.Queue[Zygote] = asyncio.Queue()
        self.zygotes: list[Zygote] = []
        self.pending = 0  # runs admitted and not finished
        self.restarts = 0

    async def start(self) -> None:
        self.zygotes = [Zygote(i, self.config) for i in range(self.size)]
        await asyncio.gather(*(z.start() for z in self.zygotes))
        for z in self.zygotes:
            self.idle.put_nowait(z)

    @property
    def isolation(self) -> dict[str, Any]:
        return self.zygotes[0].info if self.zygotes else {}

    async def stop(self) -> None:
        await asyncio.gather(*(z.stop() for z in self.zygotes), return_exceptions=True)

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        zygote = await self.idle.get()
        try:
            return await zygote.run(request)
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError, json.JSONDecodeError) as exc:
            log.warning("zygote %d failed (%r); restarting it", zygote.slot, exc)
            self.restarts += 1
            await self._restart(zygote)
            return {
                "status": "sandbox_error",
                "passed": 0,
                "total": 0,
                "message": "sandbox worker crashed; retry the run",
            }
        except asyncio.CancelledError:
            # The client went away mid-run: the zygote's answer would be read by the next run.
            await self._restart(zygote)
            raise
        finally:
            self.idle.put_nowait(zygote)

    async def _restart(self, zygote: Zygote) -> None:
        if zygote.proc and zygote.proc.returncode is None:
            zygote.proc.kill()
            await zygote.proc.wait()
        await zygote.start()
