"""Report aggregation and the report files: JSON round trip, Markdown, PNG plots, before/after."""

from __future__ import annotations

from pathlib import Path

import pytest
from crucible_trainer.evaluation import (
    Category,
    EvalConfig,
    EvalReport,
    ProblemResult,
    SampleResult,
    Timing,
    compare_reports,
    load_report,
    write_report,
)
from crucible_trainer.evaluation.hardcoded import hard_coded
from crucible_trainer.evaluation.report import aggregate, fingerprint
from crucible_trainer.evaluation.timing import ActivityClock, overlap_s
from crucible_trainer.tasks import DataSpec

PNG = b"\x89PNG\r\n\x1a\n"


def sample(mode: str, index: int, category: Category, tokens: int = 20, finish: str = "stop") -> SampleResult:
    passed = category is Category.passed
    return SampleResult(
        mode=mode,
        index=index,
        code=f"def f():\n    return {index}",
        category=category,
        status="passed" if passed else "failed",
        passed_tests=3 if passed else 1,
        total_tests=3,
        message="" if passed else "assert f() == 1 -> got 0 | with a pipe",
        tokens=tokens,
        finish_reason=finish,
    )


def make_report(correct: list[int], greedy: list[bool], n: int = 4, model: str = "smollm2") -> EvalReport:
    config = EvalConfig(n=n, ks=[1, 2, 10])
    problems = []
    for i, (c, g) in enumerate(zip(correct, greedy, strict=True)):
        samples = [
            sample("sampled", j, Category.passed if j < c else Category.wrong_answer) for j in range(n)
        ]
        first = sample(
            "greedy", 0, Category.passed if g else Category.runtime_error, tokens=10, finish="length"
        )
        problems.append(
            ProblemResult(
                task_id=f"MBPP/{11 + i}",
                dataset="mbpp",
                n=n,
                correct=c,
                greedy_passed=g,
                greedy=first,
                samples=samples,
            )
        )
    return EvalReport(
        config=config,
        data=DataSpec(limit=len(problems)),
        model=model,
        versions={"python": "3.11"},
        generator={"url": "http://gen", "id": model, "root": "/m"},
        sandbox={"url": "http://sandbox"},
        timing=Timing(wall_s=10.0, generation_s=9.5, execution_s=3.0, overlap_s=2.5),
        fingerprint=fingerprint(config, problems),
        problems=problems,
        **aggregate(problems, config),
    )


def test_aggregate() -> None:
    report = make_report(correct=[4, 1, 0], greedy=[True, False, False])
    assert report.pass_at_k == pytest.approx({1: (1 + 0.25 + 0) / 3, 2: (1 + 0.5 + 0) / 3})
    assert len(report.pass_at_k_curve) == 4 and report.pass_at_k_curve[-1] == pytest.approx(2 / 3)
    assert report.greedy_pass_at_1 == pytest.approx(1 / 3)
    assert report.failures == {
        "greedy": {"passed": 1, "runtime_error": 2},
        "sampled": {"passed": 5, "wrong_answer": 7},
    }
    assert report.mean_tokens == {"greedy": 10.0, "sampled": 20.0}
    assert report.mean_generated_tokens == pytest.approx((3 * 10 + 12 * 20) / 15)
    assert report.truncated_fraction == pytest.approx(3 / 15)
    assert report.summary() == {
        "greedy_pass@1": report.greedy_pass_at_1,
        "pass@1": report.pass_at_k[1],
        "pass@2": report.pass_at_k[2],
    }
    assert report.timing.execution_exposed_s == pytest.approx(0.5)
    assert report.timing.execution_hidden == pytest.approx(2.5 / 3)


def test_write_report_json_markdown_png(tmp_path: Path) -> None:
    report = make_report(correct=[4, 1, 0], greedy=[True, False, False])
    paths = write_report(report, tmp_path / "out")
    assert load_report(paths["json"]) == report
    assert load_report(tmp_path / "out") == report
    markdown = paths["markdown"].read_text()
    for needle in (
        "greedy pass@1 | 33.3%",
        "pass@2 (T=0.8)",
        "runtime_error",
        "execution hidden behind generation",
        "| MBPP/12 | ✗ | 1 / 4 |",
        "\\|",
        "![pass@k](pass_at_k.png)",
    ):
        assert needle in markdown, needle
    assert paths["plot"].read_bytes()[:8] == PNG


def test_greedy_only_report_plots(tmp_path: Path) -> None:
    config = EvalConfig(n=0)
    problems = [
        ProblemResult(
            task_id="HumanEval/0",
            dataset="humaneval",
            n=0,
            correct=0,
            greedy_passed=True,
            greedy=sample("greedy", 0, Category.passed),
        )
    ]
    report = EvalReport(
        config=config,
        model="m",
        timing=Timing(wall_s=1, generation_s=1, execution_s=0.1, overlap_s=0.1),
        problems=problems,
        **aggregate(problems, config),
    )
    assert report.pass_at_k == {} and report.greedy_pass_at_1 == 1.0
    paths = write_report(report, tmp_path)
    assert paths["plot"].read_bytes()[:8] == PNG
    assert "greedy pass@1 | 100.0%" in paths["markdown"].read_text()


def test_compare_reports(tmp_path: Path) -> None:
    before = make_report(correct=[1, 0, 0], greedy=[True, False, False], model="base")
    after = make_report(correct=[4, 2, 0], greedy=[False, True, True], model="job-v10")
    write_report(before, tmp_path / "before")
    paths = compare_reports(tmp_path / "before", after, tmp_path / "cmp")
    text = paths["markdown"].read_text()
    assert "| greedy pass@1 | 33.3% | 66.7% | +33.3 pts |" in text
    assert "greedy answer fixed (2): MBPP/12, MBPP/13" in text
    assert "greedy answer broken (1): MBPP/11" in text
    assert "| MBPP/12 | 0 / 4 | 2 / 4 |" in text
    assert paths["plot"].read_bytes()[:8] == PNG


def test_fingerprint_ignores_timing_but_not_answers() -> None:
    a = make_report(correct=[2], greedy=[True])
    b = make_report(correct=[2], greedy=[True])
    b.timing.wall_s = 99
    assert a.fingerprint == b.fingerprint
    assert make_report(correct=[1], greedy=[True]).fingerprint != a.fingerprint


def test_overlap_of_busy_intervals() -> None:
    assert overlap_s([(0, 4), (6, 8)], [(3, 7)]) == 2
    assert overlap_s([(0, 1)], [(1, 2)]) == 0
    assert overlap_s([], [(0, 1)]) == 0
    clock = ActivityClock()
    with clock, clock:  # nested activity counts once
        pass
    with clock:
        pass
    assert len(clock.intervals) == 2 and clock.busy_s >= 0


# Answers a model trained on a reward that pays per passed test might learn: each gives the same
# result whatever its input, however it is dressed, and the report must count it.
HARD_CODED = [
    "def is_even(n):\n    return True",
    'def is_even(n):\n    """Whether n is even."""\n    return True',
    "def pairs(xs):\n    return [(1, 2), (3, 4)]",
    "def lookup(k):\n    return {'a': -1, 'b': None}",
    "async def f(x):\n    return -3.5",
    "solve = lambda xs: 0",
    "solve: object = lambda xs: 0",  # annotated
    "import math\n\ndef area(r):\n    return 12.566",
    "def f(x):\n    pass\n    return True",
    "def f(x):\n    y = 1\n    return y",
    "def f(x):\n    x = 2\n    return 4",  # overwrites its input before any read
    "def f(x):\n    return",
    "def f(x):\n    ...",
    'def f(x):\n    return f"{1}abc"',
    "def f(x):\n    return set()",
    "def f(x):\n    return 10**9",
    "def f(x):\n    return [0] * 5",
    "def f(x):\n    return float('inf')",
    "ANSWER = True\n\ndef f(x):\n    return ANSWER",  # a module constant by name
    "class Solution:\n    def f(self, x):\n        return True",  # a method
    "def f(x):\n    def g():\n        return 1\n    return g()",  # a nested helper
    "def helper(y):\n    return y * 2\n\ndef f(x):\n    return True",  # a computed helper beside it
    "def a(x):\n    return 1\n\ndef b(y):\n    return y",
    "def answer():\n    return 42",  # takes nothing at all
    "def f(x):\n    return " + "-" * 2000 + "1",  # deeper than a recursive check goes
]
COMPUTED = [
    "def is_even(n):\n    return n % 2 == 0",
    "def is_prime(n):\n    if n < 2:\n        return False\n    return all(n % d for d in range(2, n))",
    "def f(x):\n    return [x, 1]",
    "def f(*args):\n    return sum(args)",
    "def f(x, unused=0):\n    return x",
    "f = lambda x: x * 2",
    "def f(x):\n    def g(y):\n        return y + 1\n    return g(x)",
    "def f(x):\n    def g():\n        return x + 1\n    return g()",  # a closure reads it
    "class S:\n    def solve(self, x):\n        return x * 2\n\ndef helper():\n    return 0",
    "class S:\n    def __init__(self):\n        self.a = 1\n\n    def f(self, x):\n        return x + self.a",
    "def f(x):\n    return " + "-" * 2000 + "x",  # deep, and reads x
    "def f(x):\n    return " + "[" * 100_000 + "]" * 100_000,  # deeper than Python parses: not counted
    "x = 5",  # no function
    "def f(:\n    return 1",  # not Python
    "",
]


@pytest.mark.parametrize("code", HARD_CODED)
def test_answers_that_ignore_their_input_are_hard_coded(code: str) -> None:
    assert hard_coded(code)


@pytest.mark.parametrize("code", COMPUTED)
def test_answers_that_compute_are_not_hard_coded(code: str) -> None:
    assert not hard_coded(code)


def test_report_counts_greedy_answers_that_ignore_their_input(tmp_path: Path) -> None:
    report = make_report(correct=[4, 1, 0], greedy=[True, False, False])
    assert report.hard_coded_answers == 3  # the fixture's answers are `def f(): return <index>`
    problems = report.problems
    for p in problems:
        p.greedy.code, p.samples[0].code = COMPUTED[0], HARD_CODED[2]  # sampled answers are not counted
    counted = EvalReport(**(report.model_dump() | aggregate(problems, report.config)))
    assert counted.hard_coded_answers == 0
    problems[0].greedy.code, problems[2].greedy.code = HARD_CODED[0], HARD_CODED[5]
    counted = EvalReport(**(report.model_dump() | aggregate(problems, report.config)))
    assert counted.hard_coded_answers == 2
    markdown = write_report(counted, tmp_path)["markdown"].read_text()
    assert "greedy answers that ignore their input | 2 |" in markdown


def test_a_report_written_before_the_count_loads_without_one(tmp_path: Path) -> None:
    report = make_report(correct=[4, 1, 0], greedy=[True, False, False])
    data = report.model_dump(mode="json")
    del data["hard_coded_answers"]
    older = EvalReport.model_validate(data)
    assert older.hard_coded_answers is None
    assert (
        "greedy answers that ignore their input | - |"
        in write_report(older, tmp_path)["markdown"].read_text()
    )
