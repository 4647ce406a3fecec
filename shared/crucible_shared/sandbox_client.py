"""Async client of the sandbox service, for the trainer, the evaluator and any other project.

    async with SandboxClient("http://localhost:8002") as sandbox:
        results = await sandbox.run_batch([RunRequest(code=..., tests=AssertTests(asserts=[...]))])

Large batches are split into chunks sent concurrently; a 429 is retried after its
`Retry-After`, connection errors and 5xx answers with exponential backoff. A run that still
cannot be executed comes back as a `sandbox_error` result (never an exception mid-batch),
so callers can drop it instead of scoring it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from crucible_shared.sandbox import BatchResponse, RunRequest, RunResult, RunStatus

log = logging.getLogger(__name__)


class SandboxError(Exception):
    """The sandbox refused a request (4xx other than 429): the request itself is wrong."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"{status} {error.get('field') or ''}: {error.get('message') or body}")
        self.status, self.body = status, body


class SandboxClient:
    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        chunk_size: int = 256,
        max_concurrency: int = 4,
        retries: int = 5,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)
        self.chunk_size, self.retries = chunk_size, retries
        self.gate = asyncio.Semaphore(max_concurrency)

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def health(self) -> dict[str, Any]:
        r = await self.http.get("/health")
        r.raise_for_status()
        return r.json()

    async def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return await self.health()
            except (httpx.HTTPError, OSError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def run(self, run: RunRequest) -> RunResult:
        return (await self.run_batch([run]))[0]

    async def run_batch(self, runs: Sequence[RunRequest]) -> list[RunResult]:
        chunks = [list(runs[i : i + self.chunk_size]) for i in range(0, len(runs), self.chunk_size)]
        parts = await asyncio.gather(*(self._chunk(c) for c in chunks))
        return [r for part in parts for r in part]

    async def _chunk(self, runs: list[RunRequest]) -> list[RunResult]:
        body = {"runs": [r.model_dump(mode="json") for r in runs]}
        delay = 0.2
        last: str = ""
        async with self.gate:
            for _attempt in range(self.retries + 1):
                try:
                    r = await self.http.post("/v1/runs/batch", json=body)
                except httpx.HTTPError as exc:  # connection refused/reset, timeouts
                    last = repr(exc)
                else:
                    if r.status_code == 200:
                        return BatchResponse.model_validate(r.json()).results
                    if r.status_code == 429:
                        last = "queue full"
                        await asyncio.sleep(float(r.headers.get("retry-after", delay)))
                        continue
                    if r.status_code < 500:
                        raise SandboxError(r.status_code, _json(r))
                    last = f"{r.status_code} {r.text[:200]}"
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        log.warning("sandbox unreachable after %d attempts: %s", self.retries + 1, last)
        failure = RunResult(
            status=RunStatus.sandbox_error, passed=0, total=0, message=f"sandbox unavailable: {last}"
        )
        return [failure.model_copy() for _ in runs]


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text
