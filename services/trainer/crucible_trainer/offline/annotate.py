"""Stage `annotate`: every candidate through the sandbox, with its verdict.

Runs the sandbox could not execute (`sandbox_error`: a crashed worker, an unreachable service)
are infrastructure faults, not the candidate's: they are sent again, up to `retries` more times,
and never recorded as failures; if some still fail, the stage fails and names how many. A
candidate without code is not run (status `no_code`).

Each row of `candidates_annotated.jsonl` is the candidate plus `status` (the sandbox's run
status), `passed`, `tests_passed`, `tests_total`, `fraction`, `message` (the first failure, in
one line), `verdicts` (each test's status) and `duration_ms`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from crucible_shared.jobs import AnnotateSpec
from crucible_shared.sandbox import RunResult, RunStatus
from crucible_shared.sandbox_client import SandboxClient

from crucible_trainer.tasks import Task

log = logging.getLogger(__name__)


class SandboxUnavailable(RuntimeError):
    """Some candidates could not be run even after the retries."""


async def annotate(
    rows: list[dict[str, Any]],
    problems: dict[str, Task],
    sandbox: SandboxClient,
    cfg: AnnotateSpec,
    *,
    progress: Callable[[int, int], None] | None = None,
    backoff_s: float = 1.0,
) -> list[dict[str, Any]]:
    """The rows with their verdicts, in the same order."""
    missing = sorted({r["task_id"] for r in rows} - set(problems))
    if missing:
        raise ValueError(
            f"annotate: {len(missing)} candidates' problems are not in the data ({', '.join(missing[:5])}); "
            "data changed since generate: run generate again"
        )
    limits = cfg.limits()
    results: dict[int, RunResult] = {}
    pending = [i for i, r in enumerate(rows) if r["code"].strip()]
    total, done = len(pending), 0
    for attempt in range(cfg.retries + 1):
        if attempt:
            log.warning("annotate: %d runs hit sandbox errors; retry %d", len(pending), attempt)
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
        failed = []
        for start in range(0, len(pending), cfg.batch):
            chunk = pending[start : start + cfg.batch]
            requests = [problems[rows[i]["task_id"]].run_request(rows[i]["code"], limits) for i in chunk]
            for i, result in zip(chunk, await sandbox.run_batch(requests), strict=True):
                if result.status is RunStatus.sandbox_error:
                    failed.append((i, result))
                else:
                    results[i] = result
                    done += 1
            if progress is not None:
                progress(done, total)
        pending = [i for i, _ in failed]
        if not pending:
            break
    if pending:
        raise SandboxUnavailable(
            f"annotate: the sandbox could not run {len(pending)} of {total} candidates in "
            f"{cfg.retries + 1} attempts ({failed[0][1].message}); these are infrastructure errors, not "
            "failures of the candidates: check the sandbox and run the stage again"
        )
    return [_annotated(row, results.get(i)) for i, row in enumerate(rows)]


def _annotated(row: dict[str, Any], result: RunResult | None) -> dict[str, Any]:
    if result is None:
        return {
            **row,
            "status": "no_code",
            "passed": False,
            "tests_passed": 0,
            "tests_total": 0,
            "fraction": 0.0,
            "message": "no code found in the answer",
            "verdicts": [],
            "duration_ms": 0.0,
        }
    return {
        **row,
        "status": result.status.value,
        "passed": result.status is RunStatus.passed,
        "tests_passed": result.passed,
        "tests_total": result.total,
        "fraction": result.fraction_passed,
        "message": "" if result.status is RunStatus.passed else result.message,
        "verdicts": [t.status.value for t in result.tests],
        "duration_ms": result.duration_ms,
    }
