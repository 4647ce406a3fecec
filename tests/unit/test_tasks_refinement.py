"""The SRRL refinement prompt, built only from sandbox results, and reading its answer back."""

from __future__ import annotations

import pytest
from crucible_shared import sandbox as sb
from crucible_shared.sandbox import RunResult, RunStatus, StdioCase, StdioTests
from crucible_trainer.tasks import DataSpec, Task, build_refinement_messages, extract_refined_code, load_tasks

CODE = 'def remove_Occ(s, ch):\n    print("debug", s)\n    return s.replace(ch, "")'


@pytest.fixture(scope="module")
def task() -> Task:
    return load_tasks(DataSpec(ids=[11]))[0]


def failed_result() -> RunResult:
    return RunResult(
        status=RunStatus.failed,
        passed=1,
        total=3,
        message='assert remove_Occ("hello","l") == "heo" -> got \'heo\'',
        stdout="debug hello\ndebug abcda\n",
        tests=[
            sb.TestVerdict(
                index=0, test='assert remove_Occ("abcda","a") == "bcd"', status=sb.TestStatus.passed
            ),
            sb.TestVerdict(
                index=1,
                test='assert remove_Occ("PHP","P") == "H"',
                status=sb.TestStatus.failed,
                message='assert remove_Occ("PHP","P") == "H" -> got \'H\'',
                actual="'HP'",
                expected="'H'",
            ),
            sb.TestVerdict(
                index=2, test='assert remove_Occ("hellolloll","l") == "helollol"', status=sb.TestStatus.failed
            ),
        ],
    )


def test_refinement_prompt_holds_problem_code_failing_test_values_and_output(task: Task) -> None:
    system, user = build_refinement_messages(task, CODE, failed_result())
    text = user["content"]
    assert "<analysis>" in system["content"] and "<code>" in system["content"]
    assert task.prompt in text
    assert CODE in text
    assert 'assert remove_Occ("PHP","P") == "H"' in text
    assert "Expected value: 'H'" in text and "Actual value: 'HP'" in text
    assert "1 of 3 tests passed" in text
    assert "debug hello" in text
    # The first failing test is reported, not the later ones.
    assert "hellolloll" not in text
    assert text.index("<analysis>") < text.index("<code>")


def test_refinement_prompt_for_an_exception_has_the_traceback(task: Task) -> None:
    traceback = 'Traceback (most recent call last):\n  File "<candidate>", line 2, in remove_Occ\nZeroDivisionError: division by zero'
    result = RunResult(
        status=RunStatus.error,
        passed=0,
        total=3,
        message="ZeroDivisionError: division by zero",
        tests=[
            sb.TestVerdict(
                index=0,
                test='assert remove_Occ("hello","l") == "heo"',
                status=sb.TestStatus.error,
                message="ZeroDivisionError: division by zero",
                exception_type="ZeroDivisionError",
                traceback=traceback,
            )
        ],
    )
    text = build_refinement_messages(task, "def remove_Occ(s, ch):\n    return 1 / 0", result)[1]["content"]
    assert "It raised an exception." in text
    assert "Error (ZeroDivisionError)" in text and 'File "<candidate>", line 2' in text
    assert "Output of the program: (none)" in text


def test_refinement_prompt_for_a_syntax_error(task: Task) -> None:
    result = RunResult(
        status=RunStatus.syntax_error,
        passed=0,
        total=3,
        message="SyntaxError: expected ':' (line 1)",
        exception_type="SyntaxError",
        traceback="  File \"<candidate>\", line 1\n    def f(\n         ^\nSyntaxError: expected ':'",
    )
    text = build_refinement_messages(task, "def f(", result)[1]["content"]
    assert "syntax error" in text and "SyntaxError: expected ':'" in text


def test_refinement_prompt_for_stdio_shows_input_and_outputs() -> None:
    task = Task(
        task_id="t",
        dataset="stdio",
        prompt="Add.",
        tests=StdioTests(cases=[StdioCase(input="1 2\n", output="3\n")]),
    )
    result = RunResult(
        status=RunStatus.failed,
        passed=0,
        total=1,
        message="line 1: expected '3', got '12'",
        tests=[
            sb.TestVerdict(index=0, test="1 2\n", status=sb.TestStatus.failed, expected="3\n", actual="12\n")
        ],
    )
    text = build_refinement_messages(task, "print(input().replace(' ', ''))", result)[1]["content"]
    assert "with this input:\n```\n1 2" in text
    assert "Expected output: 3" in text and "Actual output: 12" in text


def test_refinement_prompt_trims_long_output(task: Task) -> None:
    result = failed_result()
    result.stdout = "x" * 50_000
    text = build_refinement_messages(task, CODE, result)[1]["content"]
    assert len(text) < 6000 and "characters cut" in text


@pytest.mark.parametrize("status", [RunStatus.passed, RunStatus.sandbox_error])
def test_nothing_to_refine(task: Task, status: RunStatus) -> None:
    with pytest.raises(ValueError, match="nothing to refine"):
        build_refinement_messages(task, CODE, RunResult(status=status, passed=3, total=3))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "<analysis>The slice is wrong.</analysis>\n<code>\ndef f():\n    return 1\n</code>",
            "def f():\n    return 1",
        ),
        # The analysis mentions code; only the part after it counts.
        (
            "<analysis>Use `<code>` tags, e.g. ```python\nbad()\n```</analysis>\n```python\ndef f():\n    return 2\n```",
            "def f():\n    return 2",
        ),
        ("<analysis>cut off", ""),
        ("<code>def f():\n    return 3", "def f():\n    return 3"),
        ("No tags at all:\n```python\ndef f():\n    return 4\n```", "def f():\n    return 4"),
    ],
)
def test_extract_refined_code(text: str, expected: str) -> None:
    assert extract_refined_code(text) == expected
