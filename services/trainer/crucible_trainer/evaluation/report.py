"""`EvalReport`: everything an evaluation measured, per problem and in total, as one JSON document.

Failure categories, from the sandbox's run status: `wrong_answer` (ran, some answer wrong),
`runtime_error` (raised), `syntax_error`, `timeout`, `resource` (memory or output limit), plus
`no_code` (no program found in the answer) and `generation_error` (the generator refused the
request, e.g. a prompt longer than the context). Runs the sandbox could not execute
(`sandbox_error`) are dropped, never scored: they count in `dropped`, not in n.

`hard_coded_answers` counts the greedy answers whose results do not depend on their input
(`hardcoded.py`): a reward that pays for passed tests also pays for `return True`, so a trained
model that learned such answers shows here before anyone reads them.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any, Literal

from crucible_shared.sandbox import RunStatus
from pydantic import BaseModel, Field

from ..tasks.loading import DataSpec
from .config import EvalConfig
from .hardcoded import hard_coded
from .passk import mean_pass_at_k


class Category(StrEnum):
    passed = "passed"
    wrong_answer = "wrong_answer"
    runtime_error = "runtime_error"
    syntax_error = "syntax_error"
    timeout = "timeout"
    resource = "resource"
    no_code = "no_code"
    generation_error = "generation_error"
    dropped = "dropped"  # sandbox_error: not the candidate's doing, not scored


CATEGORY_OF_STATUS = {
    RunStatus.passed: Category.passed,
    RunStatus.failed: Category.wrong_answer,
    RunStatus.error: Category.runtime_error,
    RunStatus.syntax_error: Category.syntax_error,
    RunStatus.timeout: Category.timeout,
    RunStatus.memory_exceeded: Category.resource,
    RunStatus.output_exceeded: Category.resource,
    RunStatus.sandbox_error: Category.dropped,
}


class SampleResult(BaseModel):
    """One answer of the model to one problem and its verdict."""

    mode: Literal["greedy", "sampled"]
    index: int = Field(description="Sample number within the problem (0 for the greedy answer).")
    completion: str | None = Field(default=None, description="The raw answer (if `keep_completions`).")
    code: str = Field(default="", description="The candidate code extracted from it.")
    category: Category
    status: str = Field(default="", description="The sandbox's run status (empty when nothing ran).")
    passed_tests: int = 0
    total_tests: int = 0
    message: str = Field(default="", description="The first thing that went wrong, in one line.")
    tokens: int = Field(default=0, description="Generated tokens.")
    finish_reason: str | None = None

    @property
    def passed(self) -> bool:
        return self.category is Category.passed


class ProblemResult(BaseModel):
    """One problem: its greedy answer, its n samples and how many of them passed."""

    task_id: str
    dataset: str
    n: int = Field(description="Scored samples (dropped ones excluded).")
    correct: int = Field(description="Scored samples that passed.")
    greedy_passed: bool | None = Field(default=None, description="None when greedy was off or dropped.")
    greedy: SampleResult | None = None
    samples: list[SampleResult] = Field(default_factory=list)


class Timing(BaseModel):
    """Where the wall time went. Execution overlapping generation is hidden behind it."""

    wall_s: float
    generation_s: float = Field(description="Time with at least one generation request in flight.")
    execution_s: float = Field(description="Time with at least one sandbox batch in flight.")
    overlap_s: float = Field(description="Time both were busy.")

    @property
    def execution_exposed_s(self) -> float:
        """Execution time not hidden behind generation."""
        return self.execution_s - self.overlap_s

    @property
    def execution_hidden(self) -> float:
        """Fraction of execution time hidden behind generation."""
        return self.overlap_s / self.execution_s if self.execution_s > 0 else 1.0


class EvalReport(BaseModel):
    """The result of one evaluation: config and versions, metrics, failure categories, per-problem results."""

    config: EvalConfig
    data: DataSpec | None = Field(default=None, description="The selection the tasks came from, if known.")
    model: str = Field(description="The model or adapter that answered (resolved from the generator).")
    versions: dict[str, str] = Field(default_factory=dict)
    generator: dict[str, Any] = Field(default_factory=dict, description="URL and the served model's card.")
    sandbox: dict[str, Any] = Field(default_factory=dict, description="URL and its /health answer.")
    started_at: str = ""
    num_problems: int
    datasets: dict[str, int] = Field(default_factory=dict, description="Problems per dataset.")
    pass_at_k: dict[int, float] = Field(default_factory=dict, description="pass@k of the n samples, k <= n.")
    pass_at_k_curve: list[float] = Field(default_factory=list, description="pass@k for k = 1..n.")
    greedy_pass_at_1: float | None = None
    mean_generated_tokens: float | None = Field(default=None, description="Over every answer generated.")
    mean_tokens: dict[str, float] = Field(default_factory=dict, description="Per mode (greedy, sampled).")
    truncated_fraction: float = Field(default=0.0, description="Answers cut off by max_tokens.")
    failures: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="Per mode: answers in each category."
    )
    dropped: int = Field(default=0, description="Runs lost to sandbox errors (not scored).")
    hard_coded_answers: int | None = Field(
        default=None, description="Greedy answers that ignore their input (hardcoded.py); None: not counted."
    )
    timing: Timing
    fingerprint: str = Field(default="", description="Hash of config and every answer's code and verdict.")
    problems: list[ProblemResult] = Field(default_factory=list)

    def summary(self) -> dict[str, float | None]:
        """The headline numbers: greedy pass@1 and pass@k."""
        out: dict[str, float | None] = {"greedy_pass@1": self.greedy_pass_at_1}
        out.update({f"pass@{k}": v for k, v in self.pass_at_k.items()})
        return out


def aggregate(problems: list[ProblemResult], config: EvalConfig) -> dict[str, Any]:
    """The report's metrics, computed from its per-problem results."""
    counts = [(p.n, p.correct) for p in problems if p.n > 0]
    pass_k = {k: v for k in config.reported_ks if (v := mean_pass_at_k(counts, k)) is not None}
    max_n = max((n for n, _ in counts), default=0)
    curve = [v for k in range(1, max_n + 1) if (v := mean_pass_at_k(counts, k)) is not None]
    greedy = [p.greedy_passed for p in problems if p.greedy_passed is not None]
    answers = {
        "greedy": [p.greedy for p in problems if p.greedy is not None],
        "sampled": [s for p in problems for s in p.samples],
    }
    generated = [s for mode in answers.values() for s in mode if s.category is not Category.generation_error]
    failures = {
        mode: {c.value: n for c in Category if (n := sum(s.category is c for s in samples))}
        for mode, samples in answers.items()
        if samples
    }
    datasets: dict[str, int] = {}
    for p in problems:
        datasets[p.dataset] = datasets.get(p.dataset, 0) + 1
    return {
        "num_problems": len(problems),
        "datasets": datasets,
        "pass_at_k": pass_k,
        "pass_at_k_curve": curve,
        "greedy_pass_at_1": sum(greedy) / len(greedy) if greedy else None,
        "mean_generated_tokens": _mean([s.tokens for s in generated]),
        "mean_tokens": {
            mode: m
            for mode, samples in answers.items()
            if (m := _mean([s.tokens for s in samples])) is not None
        },
        "truncated_fraction": (
            sum(s.finish_reason == "length" for s in generated) / len(generated) if generated else 0.0
        ),
        "failures": failures,
        "dropped": sum(s.category is Category.dropped for mode in answers.values() for s in mode),
        "hard_coded_answers": sum(hard_coded(s.code) for s in answers["greedy"]),
    }


def fingerprint(config: EvalConfig, problems: list[ProblemResult]) -> str:
    """sha256 of the config and every answer's code and verdict: equal for reproduced evaluations."""
    body = {
        "config": config.model_dump(mode="json"),
        "answers": [
            [p.task_id, [[s.mode, s.index, s.code, s.category.value, s.passed_tests] for s in _answers(p)]]
            for p in problems
        ],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _answers(problem: ProblemResult) -> list[SampleResult]:
    return ([problem.greedy] if problem.greedy else []) + problem.samples


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None
