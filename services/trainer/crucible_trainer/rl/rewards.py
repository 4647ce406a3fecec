"""Rewards: pure functions of a sandbox result (and the completion's length).

A sandbox infrastructure fault (`sandbox_error`) is not the program's doing: `reward` returns
None for it and the caller drops the sample instead of scoring it.

>>> from crucible_shared.sandbox import RunResult
>>> ok = RunResult(status="passed", passed=3, total=3)
>>> half = RunResult(status="failed", passed=1, total=2)
>>> reward(ok, "all_pass"), reward(half, "all_pass"), reward(half, "fraction")
(1.0, 0.0, 0.5)
>>> reward(RunResult(status="syntax_error", passed=0, total=3), "graded")
-0.5
>>> reward(ok, "fraction", generated_tokens=150, length_penalty=0.1)
0.85
>>> reward(RunResult(status="sandbox_error", passed=0, total=0), "fraction") is None
True
"""

from __future__ import annotations

from typing import Literal

from crucible_shared.sandbox import RunResult, RunStatus

RewardKind = Literal["all_pass", "fraction", "graded"]


def all_pass(result: RunResult) -> float:
    """1 when every test passed, else 0."""
    return 1.0 if result.status == RunStatus.passed else 0.0


def fraction(result: RunResult) -> float:
    """Fraction of the tests that passed; nothing for a program that gives one answer to every test.

    A constant (`return True`) passes the asserts whose answer it happens to be; paying for those
    taught a policy to hard-code answers on a GPU run (docs/benchmarks.md). The sandbox says when a
    program answered every test alike although the tests expect different answers (`same_answer`).

    >>> constant = RunResult(status="failed", passed=2, total=3, same_answer=True)
    >>> fraction(constant), fraction(constant.model_copy(update={"same_answer": False}))
    (0.0, 0.6666666666666666)
    """
    if result.same_answer and result.status != RunStatus.passed:
        return 0.0
    return result.passed / result.total if result.total else 0.0


def graded(result: RunResult) -> float:
    """Execution reward: +1 ran and printed output, +0.5 ran silently, -0.5 syntax error, -1 crashed or timed out.

    "Ran" means the program and its tests executed to the end (whatever the answers were). It
    needs no tests: on a program run without them (the sandbox's `"kind": "run"`) `passed` means
    it ran to its end, and the self-play code-output game takes only +1 as a valid program.

    >>> run = lambda status, stdout="", **kw: RunResult(status=status, passed=0, total=0, stdout=stdout, **kw)
    >>> graded(run("passed", "42\\n")), graded(run("passed")), graded(run("passed", " \\n"))
    (1.0, 0.5, 0.5)
    >>> graded(run("syntax_error", exception_type="IndentationError"))
    -0.5
    >>> [graded(run(s, "partial")) for s in ("error", "timeout", "memory_exceeded", "output_exceeded")]
    [-1.0, -1.0, -1.0, -1.0]
    """
    if result.status == RunStatus.syntax_error:
        return -0.5
    if result.status in (RunStatus.passed, RunStatus.failed):
        return 1.0 if result.stdout.strip() else 0.5
    return -1.0


_KINDS = {"all_pass": all_pass, "fraction": fraction, "graded": graded}


def length_cost(generated_tokens: int, length_penalty: float) -> float:
    """What the length penalty takes off a sample's reward: alpha per 100 generated tokens.

    >>> length_cost(150, 0.1)
    0.15
    """
    return round(length_penalty * generated_tokens / 100.0, 10)


def reward(
    result: RunResult, kind: RewardKind, *, generated_tokens: int = 0, length_penalty: float = 0.0
) -> float | None:
    """The scalar reward of one sample, or None for an infrastructure fault (drop the sample)."""
    if result.status == RunStatus.sandbox_error:
        return None
    return round(_KINDS[kind](result) - length_cost(generated_tokens, length_penalty), 10)
