"""The SRRL refinement prompt: a failed attempt and what the sandbox said about it.

Everything in the prompt comes from the task and the sandbox's `RunResult`: the problem, the failed
code, the first failing test with the value it expected and the value the code produced, the error
and its traceback (trimmed to the candidate's frames by the sandbox), and the program's output. The
model is asked for an `<analysis>` of what went wrong first, then the fixed program in `<code>` tags
(`extract_refined_code` reads it back).
"""

from __future__ import annotations

from crucible_shared.sandbox import RunResult, RunStatus, TestStatus, TestVerdict

from .extract import extract_refined_code
from .prompts import problem_statement
from .task import Task

REFINE_SYSTEM = (
    "You are an expert Python programmer fixing a program that failed its tests. "
    "First explain the bug inside <analysis></analysis>, then give the complete fixed program "
    "inside <code></code>."
)
INSTRUCTION = (
    "First, inside <analysis></analysis>, explain why the code fails and how to fix it. "
    "Then write the complete corrected program inside <code></code> tags."
)
MAX_TRACEBACK = 1500
MAX_OUTPUT = 1000

_OUTCOME = {
    RunStatus.syntax_error: "It does not compile: syntax error.",
    RunStatus.memory_exceeded: "It ran out of memory.",
    RunStatus.output_exceeded: "It printed too much output.",
    RunStatus.timeout: "It ran out of time.",
    RunStatus.error: "It raised an exception.",
    RunStatus.failed: "It returned wrong answers.",
}

__all__ = ["build_refinement_messages", "describe_failure", "extract_refined_code"]


def build_refinement_messages(
    task: Task, code: str, result: RunResult, *, all_tests: bool = False
) -> list[dict[str, str]]:
    """Chat messages asking the model to analyse and fix `code`, which failed as `result` says.
    `all_tests` adds every test's PASS/FAIL line to the first failure's details."""
    if result.status in (RunStatus.passed, RunStatus.sandbox_error):
        raise ValueError(f"nothing to refine: the run's status is {result.status.value}")
    stdio = task.tests.kind == "stdio"
    happened = describe_failure(result, stdio=stdio)
    if all_tests and result.tests:
        happened += "\n\nEvery test:\n```\n" + test_log(result, stdio=stdio) + "\n```"
    user = "\n\n".join(
        [
            "## Problem\n\n" + problem_statement(task),
            f"## Your previous attempt\n\n```python\n{code.strip()}\n```",
            "## What happened when it ran\n\n" + happened,
            INSTRUCTION,
        ]
    )
    return [{"role": "system", "content": REFINE_SYSTEM}, {"role": "user", "content": user}]


def describe_failure(result: RunResult, *, stdio: bool = False) -> str:
    """The sandbox's verdict as plain text: outcome, failing test, expected vs actual, error, output."""
    parts = [_outcome(result)]
    verdict = first_failure(result)
    if verdict is not None:
        if stdio:
            parts.append(f"Failing test, with this input:\n```\n{_trim(verdict.test, MAX_OUTPUT)}\n```")
        else:
            parts.append(f"Failing test:\n```python\n{verdict.test.strip()}\n```")
        if verdict.expected is not None or verdict.actual is not None:
            label = "output" if stdio else "value"
            parts.append(
                f"Expected {label}: {_trim(verdict.expected or '', MAX_OUTPUT)}\n"
                f"Actual {label}: {_trim(verdict.actual or '', MAX_OUTPUT)}"
            )
        elif verdict.message:
            parts.append(f"Result: {verdict.message}")
    elif result.message:
        parts.append(f"Result: {result.message}")
    exception = (verdict.exception_type if verdict else None) or result.exception_type
    traceback = (verdict.traceback if verdict else None) or result.traceback
    if exception and not traceback:
        parts.append(f"Error: {exception}")
    if traceback:
        parts.append(
            f"Error ({exception or 'traceback'}):\n```\n{_trim(traceback.strip(), MAX_TRACEBACK)}\n```"
        )
    output = "\n".join(s for s in (result.stdout.strip(), result.stderr.strip()) if s)
    if output and not stdio:
        parts.append(f"Output of the program:\n```\n{_trim(output, MAX_OUTPUT)}\n```")
    elif not stdio:
        parts.append("Output of the program: (none)")
    return "\n\n".join(parts)


def test_log(result: RunResult, *, stdio: bool = False) -> str:
    """One line per test: `PASS assert f(1) == 2` / `FAIL assert f(2) == 4 -> got 5`.

    >>> from crucible_shared.sandbox import TestVerdict
    >>> r = RunResult(status="failed", passed=1, total=2, tests=[
    ...     TestVerdict(index=0, test="assert f(1) == 2", status="passed"),
    ...     TestVerdict(index=1, test="assert f(2) == 4", status="failed", message="assert f(2) == 4 -> got 5")])
    >>> print(test_log(r))
    PASS assert f(1) == 2
    FAIL assert f(2) == 4 -> got 5
    """
    lines = []
    for t in result.tests:
        shown = (
            f"case {t.index + 1}"
            if stdio
            else t.test.strip().splitlines()[0]
            if t.test.strip()
            else f"test {t.index + 1}"
        )
        mark = {TestStatus.passed: "PASS", TestStatus.not_run: "NOT RUN"}.get(t.status, "FAIL")
        detail = t.message if mark == "FAIL" and t.message and not stdio else ""
        lines.append(_trim(f"{mark} {detail or shown}", 300))
    return _trim("\n".join(lines), MAX_OUTPUT * 2)


def first_failure(result: RunResult) -> TestVerdict | None:
    """The first test that did not pass (preferring ones that ran over `not_run`)."""
    failed = [t for t in result.tests if t.status not in (TestStatus.passed, TestStatus.not_run)]
    if failed:
        return failed[0]
    return None


def _outcome(result: RunResult) -> str:
    text = _OUTCOME.get(result.status, f"Status: {result.status.value}.")
    if result.total:
        text += f" {result.passed} of {result.total} tests passed."
    return text


def _trim(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... ({len(text) - limit} characters cut) ...\n{text[-half:]}"
