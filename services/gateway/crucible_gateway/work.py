"""How much work a job asks for, bounded at submission (`CRUCIBLE_GATEWAY_MAX_WORK_TOKENS`).

Work is counted in tokens the job generates or trains on, from the spec alone:

* an online train job: `optim.steps` x `optim.problems_per_step` x samples per problem (GRPO's
  `group_size`, SRRL's `budget`, REINFORCE / PPO `samples`) x `rollout.max_tokens`, plus its
  evaluations;
* an evaluation (a job, or each of a train job's: before, every `every` steps, after): tasks x
  (`n` + 1 for `greedy`) x `max_tokens`;
* SFT / DPO: `max_steps` x the batch x `max_length`, else `epochs` x the file's rows x
  `max_length` (x 2 for DPO: chosen and rejected), the rows counted where the gateway sees the file;
* a pipeline, the stages it runs: `baseline` and `evaluate` one evaluation each; per round
  (`rounds`), `generate` tasks x `generate.k` x `generate.max_tokens` and `train` as SFT / DPO on
  the rows `build` can keep (per task at most `build.n_best` candidates for SFT, `build.max_pairs`
  pairs for DPO).

Tasks are counted from the data selection (`ids`, `id_range`, the split, `limit`); a JSONL or
stdio file counts its lines where the gateway sees it, else `limit`, else one. The refusal names
the field that sets the job's length (a pipeline's: that of its largest part).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from crucible_shared.jobs import DPOConfig, EvalJob, PipelineJob, SFTConfig, TrainJob
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


def offline_tokens(method: SFTConfig | DPOConfig, optim: Any, rows: int) -> tuple[str, int, str]:
    """SFT / DPO on `rows` rows: (the field, relative to the method, that sets the length, tokens,
    how they were counted)."""
    pairs = 2 if isinstance(method, DPOConfig) else 1
    if method.max_steps is not None:
        batch = optim.micro_batch if isinstance(optim.micro_batch, int) else 16
        batch *= optim.grad_accum or 1
        return (
            "max_steps",
            method.max_steps * batch * method.max_length * pairs,
            "max_steps x batch x max_length",
        )
    tokens = int(method.epochs * rows * method.max_length * pairs)
    return "epochs", tokens, f"epochs x {rows:,} rows x max_length"


def pipeline_work(spec: PipelineJob, lines: LineCounter) -> tuple[str, int, str]:
    """A pipeline's stages: (the field of its largest part, the tokens of all, how)."""
    parts: list[tuple[str, int, str]] = []
    evaluations = sum(stage in spec.stages for stage in ("baseline", "evaluate"))
    if evaluations:
        tokens = evaluations * eval_tokens(spec.eval, lines, "pipeline.eval")
        parts.append(("pipeline.eval.n", tokens, f"{evaluations} x tasks x (n + greedy) x max_tokens"))
    tasks = task_count(spec.data, lines, "pipeline.data")
    rounds = spec.rounds
    if "generate" in spec.stages:
        tokens = rounds * tasks * spec.generate.k * spec.generate.max_tokens
        parts.append(("pipeline.generate.k", tokens, f"{rounds} rounds x {tasks:,} tasks x k x max_tokens"))
    if "train" in spec.stages:
        k = spec.generate.k  # a problem's candidates bound what `build` keeps of it
        if isinstance(spec.train, DPOConfig):
            rows = tasks * min(spec.build.max_pairs, max(1, k * (k - 1) // 2))
        else:
            rows = tasks * min(spec.build.n_best, k)
        field, tokens, how = offline_tokens(spec.train, spec.optim, rows)
        parts.append((f"pipeline.train.{field}", rounds * tokens, f"{rounds} rounds x {how}"))
    if not parts:
        return "pipeline.stages", 0, "no stage generates or trains"
    field = max(parts, key=lambda part: part[1])[0]
    return field, sum(part[1] for part in parts), "; ".join(part[2] for part in parts)


def job_work(spec: Any, lines: LineCounter) -> tuple[str, int, str] | None:
    """(the field that sets the job's length, its tokens, how they were counted), or None for a
    job not bounded here."""
    if isinstance(spec, EvalJob):
        tokens = eval_tokens(spec, lines, "eval")
        return "eval.n", tokens, "tasks x (n + greedy) x max_tokens"
    if isinstance(spec, PipelineJob):
        return pipeline_work(spec, lines)
    if not isinstance(spec, TrainJob):
        return None
    method = spec.method
    if isinstance(method, SFTConfig | DPOConfig):
        rows = 1 if method.max_steps is not None else lines("train.method.path", method.path or "") or 1
        field, tokens, how = offline_tokens(method, spec.optim, rows)
        return f"train.method.{field}", tokens, how
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
