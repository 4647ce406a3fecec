"""Stage `generate`: K candidates per problem, sampled through the generator pool.

One request per problem (`n = K`), `concurrency` of them in flight, so the generator decodes many
problems in one batch. Prompts are the ones evaluation uses (`tasks.build_messages` for chat
models, `tasks.build_completion_prompt` otherwise), so a model trained on the candidates is
evaluated on the prompts it was trained on. Each problem samples with a seed derived from (seed,
round, task id): a re-run against the same generator gives the same candidates.

Rows of `candidates.jsonl`: `task_id`, `index` (0..K-1), `round`, `prompt` (messages or text),
`completion` (the raw answer), `code` (the program extracted from it, "" when none), `tokens`,
`finish_reason`, `model` (the served name that answered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from crucible_shared.generator_client import GeneratorPool
from crucible_shared.jobs import GenerateSpec

from crucible_trainer import tasks
from crucible_trainer.evaluation import task_seed
from crucible_trainer.tasks import Task


def prompt_of(task: Task, chat: bool) -> list[dict[str, str]] | str:
    return tasks.build_messages(task) if chat else tasks.build_completion_prompt(task)


async def generate(
    problems: list[Task],
    pool: GeneratorPool,
    cfg: GenerateSpec,
    *,
    model: str,
    chat: bool,
    seed: int,
    round: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """`cfg.k` candidates of every problem, problems in order."""
    gate = asyncio.Semaphore(cfg.concurrency)
    done = 0

    async def one(task: Task) -> list[dict[str, Any]]:
        nonlocal done
        prompt = prompt_of(task, chat)
        sampling = {
            "model": model,
            "n": cfg.k,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "seed": task_seed(seed * 1009 + round, task.task_id),
            "stop": tasks.stop_sequences(task, chat),
        }
        async with gate:
            if chat:
                response: Any = await pool.chat(prompt, **sampling)  # type: ignore[arg-type]
            else:
                response = await pool.complete(prompt, **sampling)
        rows = []
        for choice in sorted(response.choices, key=lambda c: c.index):
            text = (choice.message.content or "") if chat else choice.text
            rows.append(
                {
                    "task_id": task.task_id,
                    "index": choice.index,
                    "round": round,
                    "prompt": prompt,
                    "completion": text,
                    "code": tasks.answer_to_code(task, text, chat=chat),
                    "tokens": len(choice.token_ids) if choice.token_ids is not None else 0,
                    "finish_reason": choice.finish_reason,
                    "model": model,
                }
            )
        done += 1
        if progress is not None:
            progress(done, len(problems))
        return rows

    groups = await asyncio.gather(*(one(t) for t in problems))
    return [row for group in groups for row in group]
