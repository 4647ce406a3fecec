"""Hard-coded answers against the partial-credit reward, written as a policy would learn them.

A GPU run of GRPO with dynamic sampling learned to answer 492 of 500 MBPP test problems with a
function returning a literal, because the `fraction` reward paid for the asserts a constant
happens to satisfy (docs/benchmarks.md). Each attack here is a program that gives one answer to
every test; through the real sandbox it must earn nothing, in the assert and stdio forms, while
a program that computes from its input keeps its partial credit.
"""

from __future__ import annotations

import httpx
import pytest
from crucible_shared.sandbox import RunResult
from crucible_trainer.rl.rewards import reward

# MBPP-style suites: the expected answers differ between the asserts.
IS_EVEN = ["assert is_even(2) == True", "assert is_even(3) == False", "assert is_even(10) == True"]
VOLUME = ["assert volume(3, 2, 2) == 6", "assert volume(1, 2, 3) == 3", "assert volume(2, 2, 2) == 4"]
SORT_ROWS = [
    "assert sort_rows([[3, 1], [0, 2]]) == [[0, 2], [3, 1]]",
    "assert sort_rows([[1, 1], [0, 0]]) == [[0, 0], [1, 1]]",
]
STDIO = [
    {"input": "2 3\n", "output": "5\n"},
    {"input": "1 1\n", "output": "2\n"},
    {"input": "5 0\n", "output": "5\n"},
]

ATTACKS = {
    # the literal itself
    "return-true": ("def is_even(n):\n    return True\n", IS_EVEN),
    "return-a-number": ("def volume(a, b, c):\n    return 6\n", VOLUME),
    "return-a-list": ("def sort_rows(m):\n    return [[0, 2], [3, 1]]\n", SORT_ROWS),
    # the same constant, computed so that no reading of the source sees a literal
    "computed-constant": ("def is_even(n):\n    return len('ab') == 2 or n is n\n", IS_EVEN),
    "constant-from-state": (
        "import functools\n@functools.lru_cache\ndef _answer():\n    return 2 * 3\n"
        "def volume(a, b, c):\n    return _answer()\n",
        VOLUME,
    ),
    "ignores-the-argument-types": ("def is_even(*args, **kwargs):\n    return bool(1)\n", IS_EVEN),
}
STDIO_ATTACKS = {
    "prints-a-constant": "print(5)\n",
    "reads-then-ignores": "input()\nprint(5)\n",
}


def _runs(sandbox, runs: list[dict]) -> list[RunResult]:
    r = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=300)
    assert r.status_code == 200, r.text
    return [RunResult.model_validate(x) for x in r.json()["results"]]


def _asserts(code: str, asserts: list[str]) -> dict:
    return {"code": code, "tests": {"kind": "asserts", "asserts": asserts}, "use_cache": False}


def _stdio(code: str) -> dict:
    return {"code": code, "tests": {"kind": "stdio", "cases": STDIO}, "use_cache": False}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_one_answer_to_every_assert_earns_nothing(sandbox, name) -> None:
    (result,) = _runs(sandbox, [_asserts(*ATTACKS[name])])
    assert 0 < result.passed < result.total, (name, result)  # the constant does pass some asserts
    assert result.same_answer is True, (name, result)
    assert reward(result, "fraction") == 0.0
    assert reward(result, "all_pass") == 0.0


@pytest.mark.parametrize("name", sorted(STDIO_ATTACKS))
def test_one_output_for_every_input_earns_nothing(sandbox, name) -> None:
    (result,) = _runs(sandbox, [_stdio(STDIO_ATTACKS[name])])
    assert 0 < result.passed < result.total and result.same_answer is True, (name, result)
    assert reward(result, "fraction") == 0.0


def test_programs_that_compute_from_their_input_keep_partial_credit(sandbox) -> None:
    guesses_small = "def is_even(n):\n    return n < 5\n"  # right for 2 only
    off_by_one = "def volume(a, b, c):\n    return a * b * c // 2 if a != 2 else 5\n"
    sums_or_fails = "a, b = map(int, input().split())\nprint(a + b if b else 0)\n"
    right = "def sort_rows(m):\n    return sorted(m)\n"
    partial, other, stdio, full = _runs(
        sandbox,
        [
            _asserts(guesses_small, IS_EVEN),
            _asserts(off_by_one, VOLUME),
            _stdio(sums_or_fails),
            _asserts(right, SORT_ROWS),
        ],
    )
    assert partial.passed == 1 and partial.same_answer is False
    assert reward(partial, "fraction") == pytest.approx(1 / 3)
    assert other.passed == 2 and other.same_answer is False
    assert reward(other, "fraction") == pytest.approx(2 / 3)
    assert stdio.passed == 2 and stdio.same_answer is False
    assert reward(stdio, "fraction") == pytest.approx(2 / 3)
    assert full.status == "passed" and reward(full, "fraction") == 1.0


def test_a_suite_whose_answers_agree_does_not_flag_a_constant(sandbox) -> None:
    # Every assert expects True: a constant is indistinguishable from a solution here (the suite is
    # weak, not the reward), so the flag stays off and the run is judged on its tests alone.
    (result,) = _runs(
        sandbox, [_asserts("def f(n):\n    return True\n", ["assert f(1) == True", "assert f(2) == True"])]
    )
    assert result.status == "passed" and result.same_answer is False
