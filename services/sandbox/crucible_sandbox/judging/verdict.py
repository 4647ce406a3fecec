"""Trusted judgement of a test suite: turn what a run's processes reported into a `RunResult`.

This runs in the worker, outside the run. For a call plan the program reports only values: each
is rebuilt from plain types and compared here with the literal the test expects. For a judged plan
the judge's report (a process that never runs the program) carries the verdicts; the program's
tells only how it crashed. Stdin/stdout cases and runs without tests are judged in `output`; how
a process ended, and the parts of every result, are in `outcome`.
"""

from __future__ import annotations

import re
from typing import Any

from crucible_sandbox.judging.compile import SyntaxFrame
from crucible_sandbox.judging.outcome import (
    Frame,
    ProcessOutcome,
    as_text,
    base,
    crashed,
    ended_how,
    failure_message,
    finish,
    not_run,
    not_started,
    unfinished,
)
from crucible_sandbox.judging.plan import Call, Plan
from crucible_sandbox.wire.messages import RunResultData, RunStatusName, TestVerdictData
from crucible_sandbox.wire.values import decode, short_repr

_SURROGATE = re.compile("[\ud800-\udfff]")
MALFORMED = "the program wrote malformed data to the harness channel"


def syntax_error(frame: SyntaxFrame, tests: list[str]) -> RunResultData:
    """The result for a program that does not compile: no test ran."""
    out = base(len(tests), ProcessOutcome())
    out.update(
        {
            "status": "syntax_error",
            "message": str(frame.get("msg", "syntax error")),
            "traceback": frame.get("tb"),
            "exception_type": frame.get("exc", "SyntaxError"),
            "tests": [not_run(i, s) for i, s in enumerate(tests)],
        }
    )
    return out


def clean_text(value: Any) -> Any:
    """`value` with every lone surrogate in its strings replaced (they cannot be sent as UTF-8).

    >>> clean_text({"m": "a\\ud800b"})
    {'m': 'a\\ufffdb'}
    """
    if isinstance(value, str):
        return value if value.isascii() else _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [clean_text(v) for v in value]
    if isinstance(value, dict):
        return {k: clean_text(v) for k, v in value.items()}
    return value


# -- call plans -----------------------------------------------------------------------------------


def judge_calls(plan: Plan, proc: ProcessOutcome) -> RunResultData:
    """Verdict of a call plan: each value the program reported, compared here with the literal."""
    assert plan.calls is not None
    out = base(len(plan.tests), proc)
    if not proc.started:
        return not_started(out, plan.tests, proc, "harness")
    crash = proc.first("crash")
    records: dict[int, Frame] = {}
    for frame in proc.frames[1:]:
        i = frame.get("i")
        if frame.get("t") == "test" and type(i) is int and 0 <= i < len(plan.tests):
            records.setdefault(i, frame)
    if crash is not None and not records:
        return crashed(out, plan.tests, crash, proc, "while loading the program")
    calls = plan.calls

    def judge(i: int, source: str, rec: Frame) -> TestVerdictData:
        return _judge_call(plan.sites[i].source, calls[i], i, source, rec)

    done = proc.first("done") is not None
    verdicts = unfinished(plan.tests, records, done, proc, judge)
    out = finish(out, verdicts, proc, ["error"] if proc.malformed else [])
    out["same_answer"] = same_answer(
        [
            (value, calls[i].expected)
            for i, rec in sorted(records.items())
            if calls[i].op == "==" and (value := _decoded(rec)) is not _NOTHING
        ]
    )
    return out


_NOTHING = object()


def _decoded(rec: Frame) -> Any:
    """The value a test's record reports, or `_NOTHING` (it crashed, timed out, or is malformed)."""
    if "value" not in rec:
        return _NOTHING
    try:
        return decode(rec["value"])
    except ValueError:
        return _NOTHING


def same_answer(pairs: list[tuple[Any, Any]]) -> bool | None:
    """Whether the program gave one answer to every test although the tests expect different ones.

    Such a program ignores its input: whatever tests it passes, it passes because the constant it
    returns happens to be their answer (`return True` against asserts expecting True and False).
    A reward that pays per test passed must not pay for that. None: fewer than two answers.

    >>> same_answer([(True, True), (True, False), (True, True)])
    True
    >>> same_answer([(1, 1), (2, 2)]), same_answer([(5, 5), (5, 5)])  # answers vary; tests agree
    (False, False)
    >>> same_answer([(1, 1), (True, 2)])  # 1 and True are different answers
    False
    >>> same_answer([(3, 3)]) is None
    True
    """
    if len(pairs) < 2:
        return None

    def same(a: Any, b: Any) -> bool:
        try:
            return type(a) is type(b) and bool(a == b)
        except Exception:  # plain data compares; anything else counts as different
            return False

    (first, first_expected), rest = pairs[0], pairs[1:]
    return all(same(first, v) for v, _ in rest) and not all(same(first_expected, e) for _, e in rest)


def _judge_call(site: str, call: Call, index: int, source: str, rec: Frame) -> TestVerdictData:
    ms: Any = rec.get("ms")
    v: TestVerdictData = {
        "index": index,
        "test": source,
        "status": "passed",
        "message": "",
        "judged_outside": True,
        "duration_ms": round(float(ms), 3) if type(ms) in (int, float) else 0.0,
    }
    op = None if call.op in ("truth", "not") else call.op
    if rec.get("timeout") is True:
        v.update({"status": "timeout", "message": "time limit exceeded"})
    elif isinstance(rec.get("error"), dict):
        err = rec["error"]
        v.update(
            {
                "status": "error",
                "exception_type": as_text(err.get("exc"), 100),
                "message": as_text(err.get("msg"), 500) or "error",
                "traceback": as_text(err.get("tb")),
                "memory": err.get("memory") is True,
            }
        )
    elif isinstance(rec.get("other"), dict):
        type_name, actual = (
            as_text(rec["other"].get("type"), 100),
            as_text(rec["other"].get("repr"), 300) or "?",
        )
        why: str | None = f"a {type_name} is not plain data: it is not compared outside the program"
        v.update(
            {
                "status": "failed",
                "judged_outside": False,
                "actual": actual,
                "message": failure_message(site, op, actual, None, why),
            }
        )
    elif "value" in rec:
        try:
            value = decode(rec["value"])
        except ValueError:
            return {**v, "status": "error", "message": MALFORMED}
        ok, why = _holds(call, value)
        if not ok:
            actual = short_repr(value)
            expected = short_repr(call.expected) if op else None
            v.update(
                {
                    "status": "failed",
                    "actual": actual,
                    "expected": expected,
                    "message": failure_message(site, op, actual, expected, why),
                }
            )
    else:
        v.update({"status": "error", "message": MALFORMED})
    return v


def _holds(call: Call, value: Any) -> tuple[bool, str | None]:
    """Whether the test's assertion holds for the program's value (plain data on both sides)."""
    try:
        if call.op == "==":
            outcome = value == call.expected
        elif call.op == "!=":
            outcome = value != call.expected
        else:
            outcome = bool(value) if call.op == "truth" else not bool(value)
        return bool(outcome), None
    except Exception as e:  # e.g. a signalling NaN: the values cannot be compared
        return False, f"comparing the values raised {type(e).__name__}"


# -- judged plans ---------------------------------------------------------------------------------


def judge_judged(plan: Plan, program: ProcessOutcome, judge: ProcessOutcome) -> RunResultData:
    """Verdict of a judged plan, from the judge's report (the program's tells how it crashed)."""
    out = base(len(plan.tests), program)
    ended = judge if judge.killed else program
    if not judge.started:
        return not_started(out, plan.tests, ended, "judge")
    fault = judge.first("judge_error")
    if fault is not None:
        out.update(
            {
                "status": "sandbox_error",
                "message": f"judge error: {as_text(fault.get('msg'), 500)}",
                "tests": [],
            }
        )
        return out
    if judge.first("program_failed") is not None:
        return _program_failed(out, plan.tests, program)
    missing = judge.first("missing")
    if missing is not None:
        crash = {
            "exc": "NameError",
            "msg": f"NameError: the program does not define `{as_text(missing.get('name'), 100)}`",
        }
        return crashed(out, plan.tests, crash, program, "no function to test")
    records: dict[int, Frame] = {}
    for frame in judge.frames[1:]:
        i = frame.get("i")
        if frame.get("t") == "test" and type(i) is int and 0 <= i < len(plan.tests):
            records.setdefault(i, frame)
    setup = judge.first("setup_error")
    if setup is not None and not records:
        where = (
            "in the program, called from the test set-up" if setup.get("program") else "in the test set-up"
        )
        return crashed(out, plan.tests, setup, program, where)

    def verdict_of(i: int, source: str, rec: Frame) -> TestVerdictData:
        return _judge_record(plan, i, source, rec, program)

    done = judge.first("done") is not None
    verdicts = unfinished(plan.tests, records, done, ended, verdict_of)
    extra: list[RunStatusName] = ["error"] if setup is not None else []
    return finish(out, verdicts, program if program.killed else judge, extra)


def _program_failed(out: RunResultData, tests: list[str], program: ProcessOutcome) -> RunResultData:
    if not program.started:
        return not_started(out, tests, program, "harness")
    crash = program.first("crash")
    if crash is None:
        crash = {"exc": None, "msg": ended_how(program)[1]}
    return crashed(out, tests, crash, program, "while loading the program")


def _judge_record(
    plan: Plan, index: int, source: str, rec: Frame, program: ProcessOutcome
) -> TestVerdictData:
    ms: Any = rec.get("ms")
    helpers = rec.get("helpers")
    v: TestVerdictData = {
        "index": index,
        "test": source,
        "status": "passed",
        "message": "",
        "judged_outside": rec.get("judged") is not False,
        "program_helpers": [h for h in helpers if isinstance(h, str)][:20]
        if isinstance(helpers, list)
        else [],
        "duration_ms": round(float(ms), 3) if type(ms) in (int, float) else 0.0,
    }
    status = rec.get("status")
    if status == "failed":
        fail: dict[str, Any] = rec["fail"] if isinstance(rec.get("fail"), dict) else {}
        site_id = fail.get("site")
        site = plan.sites[site_id] if type(site_id) is int and 0 <= site_id < len(plan.sites) else None
        actual, expected = as_text(fail.get("actual"), 300), as_text(fail.get("expected"), 300)
        why = as_text(rec.get("why"), 300)
        v.update({"status": "failed", "actual": actual, "expected": expected})
        if site is not None:
            v["message"] = failure_message(site.source, site.op, str(actual), expected, why)
        else:
            v["message"] = (
                f"{source.splitlines()[0] if source else 'assert'} -> not judged: {why}"
                if why
                else "assertion failed"
            )
    elif status == "timeout":
        v.update({"status": "timeout", "message": "time limit exceeded"})
    elif status == "error" and rec.get("lost"):
        status_, message = (
            ended_how(program) if program.killed or program.signal else ("error", str(rec["lost"]))
        )
        v.update({"status": status_, "message": message})
    elif status == "error":
        v.update(
            {
                "status": "error",
                "exception_type": as_text(rec.get("exc"), 100),
                "message": as_text(rec.get("msg"), 500) or "error",
                "traceback": as_text(rec.get("tb")),
                "memory": rec.get("memory") is True,
            }
        )
    elif status != "passed":
        v.update({"status": "error", "message": "the judge reported nothing usable for this test"})
    return v
