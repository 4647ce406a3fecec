"""How much work a job asks for, bounded at submission (`CRUCIBLE_GATEWAY_MAX_WORK_TOKENS`).

Work is counted in tokens the job generates or trains on, from the spec alone:

* an online train job: `optim.steps` x `optim.problems_per_step` x samples per problem (GRPO's
  `group_size`, SRRL's `budget`, REINFORCE / PPO `samples`) x `rollout.max_tokens`, plus its
  evaluations;
* an evaluation (a job, or each of a train job's: before, every `every` steps, after): tasks x
  (`n` + 1 for `greedy`) x `max_tokens`;
* SFT / DPO: `max_steps` x the batch x `max_length`, else `epochs` x the file's rows x
  `max_length` (x 2 for DPO: chosen and rejected), the rows counted where the gateway sees the file.

Tasks are counted from the data selection (`ids`, `id_range`, the split, `limit`); a JSONL or
stdio file counts its lines where the gateway sees it, else `limit`, else one. A pipeline's stages
are not counted yet. The refusal names the field that sets the job's length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from crucible_shared.jobs import DPOConfig, EvalJob, SFTConfig, TrainJob
from crucible_shared.jobs.data import MBPP_SPLITS, DataSpec

HUMANEVAL_SPLITS = {"train": 131, "test": 33, "all": 164}

# Lines of a file the spec names (None: the gateway cannot read it).
LineCounter = Callable[[str, str], int | None]


def task_count(data: DataSpec, lines: LineCounter, field: str) -> int:
    """How many tasks the selection keeps (an upper bound)."""
    count: int | None
    if data.path is not None:
        count = lines(f"{field}.path", data.path)
    elif data.ids is not None:
        count = len(data.ids)
    elif data.dataset == "mbpp":
        low, high = MBPP_SPLITS[data.effective_split]
        if data.id_range is not None:
            low, high = max(low, data.id_range[0]), min(high, data.id_range[1])
        count = max(0, high - low + 1)
    elif data.dataset == "humaneval":
        count = HUMANEVAL_SPLITS.get(data.effective_split, 164)
        if data.id_range is not None:
            count = min(count, data.id_range[1] - data.id_range[0] + 1)
    else:
        count = None
    if data.limit is not None:
        count = data.limit if count is None else min(count, data.limit)
    return max(1, count or 1)


def eval_tokens(spec: Any, lines: LineCounter, field: str) -> int:
    """One evaluation's tokens."""
    return task_count(spec.data, lines, f"{field}.data") * (spec.n + int(spec.greedy)) * spec.max_tokens


def samples_per_problem(method: Any) -> int:
    """The method's samples per problem (its config class names the field), 1 for a method
    that samples no problems."""
    return int(getattr(method, method.per_problem)) if method.per_problem else 1


def job_work(spec: Any, lines: LineCounter) -> tuple[str, int, str] | None:
    """(the field that sets the job's length, its tokens, how they were counted), or None for a
    job not bounded here (a pipeline)."""
    if isinstance(spec, EvalJob):
        tokens = eval_tokens(spec, lines, "eval")
        return "eval.n", tokens, "tasks x (n + greedy) x max_tokens"
    if not isinstance(spec, TrainJob):
        return None
    method = spec.method
    if isinstance(method, SFTConfig | DPOConfig):
        pairs = 2 if isinstance(method, DPOConfig) else 1
        if method.max_steps is not None:
            batch = spec.optim.micro_batch if isinstance(spec.optim.micro_batch, int) else 16
            batch *= spec.optim.grad_accum or 1
            tokens = method.max_steps * batch * method.max_length * pairs
            return "train.method.max_steps", tokens, "max_steps x batch x max_length"
        rows = lines("train.method.path", method.path or "") or 1
        tokens = int(method.epochs * rows * method.max_length * pairs)
        return "train.method.epochs", tokens, f"epochs x {rows} rows x max_length"
    tokens = (
        spec.optim.steps
        * spec.optim.problems_per_step
        * samples_per_problem(method)
        * spec.rollout.max_tokens
    )
    if spec.eval is not None:
        runs = int(spec.eval.before) + 1 + (spec.optim.steps // spec.eval.every if spec.eval.every else 0)
        tokens += runs * eval_tokens(spec.eval, lines, "train.eval")
    return "train.optim.steps", tokens, "steps x problems_per_step x samples x max_tokens, plus evaluations"
