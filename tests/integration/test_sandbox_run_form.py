"""Programs without tests (`"kind": "run"`): what a program did, under the same isolation and limits.

The statuses must let a pure function tell apart: ran and printed, ran silently, did not
compile, crashed or ran out of time (the trainer's graded execution reward).
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration import sandbox_programs as hostile
from tests.integration.test_sandbox_isolation import HOSTILE, LIMITS


def _batch(sandbox, runs: list[dict]) -> list[dict]:
    r = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def _run(code: str, **options) -> dict:
    limits = options.pop("limits", None)
    run = {"code": code, "tests": {"kind": "run", **options}, "use_cache": False}
    if limits:
        run["limits"] = limits
    return run


def graded(result: dict) -> float | None:
    """The graded execution reward, as the trainer computes it from a result (issue 13)."""
    if result["status"] == "sandbox_error":
        return None
    if result["status"] == "passed":
        return 1.0 if result["stdout"].strip() else 0.5
    if result["status"] == "syntax_error":
        return -0.5
    return -1.0


def test_statuses_tell_the_graded_reward_cases_apart(sandbox) -> None:
    programs = {
        "prints": ("print('hello')\n", 1.0),
        "silent": ("x = 1 + 1\n", 0.5),
        "exit-0": ("print('bye')\nraise SystemExit(0)\n", 1.0),
        "syntax": ("def f(:\n    pass\n", -0.5),
        "indentation": ("def f():\nreturn 1\n", -0.5),
        "raises": ("print('before')\n1 / 0\n", -1.0),
        "exit-2": ("import sys\nsys.exit(2)\n", -1.0),
        "timeout": ("while True:\n    pass\n", -1.0),
    }
    runs = [_run(code, limits={"wall_time_s": 2}) for code, _ in programs.values()]
    results = dict(zip(programs, _batch(sandbox, runs), strict=True))
    for name, (_, reward) in programs.items():
        assert graded(results[name]) == reward, (name, results[name])
    assert results["prints"]["stdout"] == "hello\n" and results["prints"]["total"] == 0
    assert results["indentation"]["exception_type"] == "IndentationError"
    assert results["syntax"]["exception_type"] == "SyntaxError"
    raised = results["raises"]
    assert raised["status"] == "error" and raised["exception_type"] == "ZeroDivisionError"
    assert 'File "<candidate>", line 2' in raised["traceback"] and raised["stdout"] == "before\n"
    assert results["exit-2"]["status"] == "error" and "2" in results["exit-2"]["message"]
    assert results["timeout"]["status"] == "timeout"
    assert all(r["duration_ms"] >= 0 for r in results.values())


def test_value_of_the_final_expression_and_of_a_call(sandbox) -> None:
    code = "def f(a, b=1):\n    return [a, b]\nx = {'k': (1, 2)}\nx\n"
    last, call, kw, missing, raising, stdin = _batch(
        sandbox,
        [
            _run(code, value="last_expression"),
            _run(code, call={"function": "f", "args": [3]}),
            _run(code, call={"function": "f", "args": ["a"], "kwargs": {"b": None}}),
            _run(code, call={"function": "g"}),
            _run(code + "def boom():\n    raise KeyError('k')\n", call={"function": "boom"}),
            _run(
                "import sys\nprint(sys.stdin.read().upper())\nlen(sys.argv)\n",
                stdin="abc",
                value="last_expression",
            ),
        ],
    )
    assert (last["status"], last["value"], last["value_type"]) == ("passed", "{'k': (1, 2)}", "dict")
    assert (call["status"], call["value"]) == ("passed", "[3, 1]")
    assert kw["value"] == "['a', None]"
    assert missing["status"] == "error" and missing["exception_type"] == "NameError"
    assert raising["status"] == "error" and raising["exception_type"] == "KeyError"
    assert raising["value"] is None
    assert stdin["stdout"] == "ABC\n" and stdin["value"] == "1"
    plain = _batch(sandbox, [_run(code)])[0]
    assert plain["status"] == "passed" and plain["value"] is None


def test_run_form_is_cached_like_any_run(sandbox) -> None:
    body = {"code": "print('cache me')\n", "tests": {"kind": "run"}}
    first = httpx.post(f"{sandbox.url}/v1/runs", json=body, timeout=30).json()
    second = httpx.post(f"{sandbox.url}/v1/runs", json=body, timeout=30).json()
    assert (first["cached"], second["cached"]) == (False, True) and second["stdout"] == "cache me\n"


@pytest.mark.parametrize(
    ("tests", "field"),
    [
        ({"kind": "run", "value": "last_expression", "call": {"function": "f"}}, "tests.run"),
        ({"kind": "run", "call": {"function": "not a name"}}, "tests.run.call.function"),
        ({"kind": "run", "value": "everything"}, "tests.run.value"),
        ({"kind": "run", "stdin": 5}, "tests.run.stdin"),
    ],
)
def test_bad_run_options_get_the_envelope(sandbox, tests, field) -> None:
    r = httpx.post(f"{sandbox.url}/v1/runs", json={"code": "x = 1", "tests": tests})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == field


def test_openapi_describes_the_run_form(sandbox) -> None:
    spec = httpx.get(f"{sandbox.url}/openapi.json").json()
    assert "RunOnly" in spec["components"]["schemas"]
    assert "value" in spec["components"]["schemas"]["RunResult"]["properties"]


# -- isolation: the adversarial programs, run without tests ---------------------------------------


@pytest.mark.slow
def test_hostile_programs_are_contained_without_tests(sandbox) -> None:
    # Each hostile program, with a call of the function it defines as the "run".
    runs = [
        _run(code, call={"function": "f", "args": [0] if "f(n)" in code else []}, limits=LIMITS)
        for code, _, _ in HOSTILE.values()
    ]
    expected = {
        "infinite_loop": {"timeout"},
        "sigalrm_ignored": {"timeout"},
        "sleep": {"timeout"},
        "fork_bomb": {"timeout", "error"},
        "setsid_daemon": {"passed"},
        "memory_bomb": {"memory_exceeded"},
        "deep_recursion": {"error"},
        "stdout_flood": {"output_exceeded"},
        "stderr_flood": {"output_exceeded"},
        "disk_fill": {"error"},
        "network": {"error"} if hostile_full() else {"error", "passed"},
        "kill_parent": {"error"},
    }
    for name, result in zip(HOSTILE, _batch(sandbox, runs), strict=True):
        assert result["status"] in expected[name], (name, result["status"], result["message"])
    assert httpx.get(f"{sandbox.url}/health").json()["status"] == "ok"


def hostile_full() -> bool:
    import os

    return os.geteuid() == 0


@pytest.mark.parametrize("program", sorted(hostile.disk_finders()))
def test_run_form_sees_no_dataset_files(sandbox, program) -> None:
    code = hostile.disk_finders()[program]
    (out,) = _batch(
        sandbox, [_run(code, call={"function": "answer", "args": [1]}, limits={"wall_time_s": 30})]
    )
    assert out["status"] == "passed" and out["value"] == "[]", (out["message"], out["value"])


def test_run_form_garbage_on_the_report_channel(sandbox) -> None:
    from tests.integration.test_sandbox_robustness import GARBAGE

    runs = [_run(code, call={"function": "add", "args": [1, 2]}) for code in GARBAGE.values()]
    for name, result in zip(GARBAGE, _batch(sandbox, runs), strict=True):
        assert result["status"] != "sandbox_error", (name, result["message"])


# A forged end of run: "done" frames written to every descriptor the harness might report on, then
# the program fails in a way of its own. The header is the channel's (4-byte big-endian length).
FORGE = (
    "import json, os, struct, sys\n"
    "print('output as if it had run')\n"
    "sys.stdout.flush()\n"
    "for value in ({'t': 'done'}, {'t': 'done', 'value': '42', 'value_type': 'int'}):\n"
    "    body = json.dumps(value, separators=(',', ':')).encode()\n"
    "    for fd in range(3, 64):\n"
    "        try:\n"
    "            os.write(fd, struct.pack('>I', len(body)) + body)\n"
    "        except OSError:\n"
    "            pass\n"
)
FORGED_ENDINGS = {
    "raise": "1 / 0\n",
    "sys_exit_3": "raise SystemExit(3)\n",
    "sigkill_itself": "import signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "abort": "os.abort()\n",
    "os_exit_1": "os._exit(1)\n",
}


@pytest.mark.parametrize("ending", sorted(FORGED_ENDINGS))
def test_a_forged_end_of_run_does_not_turn_a_crash_into_a_pass(sandbox, ending) -> None:
    result = _batch(sandbox, [_run(FORGE + FORGED_ENDINGS[ending], value="last_expression")])[0]
    assert result["status"] == "error", result
    assert graded(result) == -1.0


def test_exiting_with_status_zero_is_a_run_to_its_end(sandbox) -> None:
    results = _batch(
        sandbox,
        [
            _run("import os\nprint('bye')\nimport sys\nsys.stdout.flush()\nos._exit(0)\n"),
            _run(FORGE + "os._exit(0)\n"),  # a forged end changes nothing here: it did exit 0
        ],
    )
    assert [r["status"] for r in results] == ["passed", "passed"], results
