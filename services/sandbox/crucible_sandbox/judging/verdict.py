"""Trusted judgement: turn what a run's processes reported, and how they ended, into a `RunResult`.

This runs in the worker, outside the run. The program's report is untrusted input: its first
frame, `started`, is written before any of the program runs, so a report without it means the
sandbox failed (`sandbox_error`); everything after it is the program's doing, and garbage there is
a verdict about the program. `ProcessOutcome.of` keeps the frames as far as they parse, and only
those that are JSON objects; they are read with `dict.get` and exact type checks. For a call plan
the program reports only values: each is rebuilt from plain types and compared here with the
literal the test expects. For a judged plan the judge's report (a process that never runs the
program) carries the verdicts. A run's exit status and its stdout never decide `passed`.
Stdin/stdout cases and runs without tests are judged in `output`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from crucible_sandbox.judging.compile import SyntaxFrame
from crucible_sandbox.judging.plan import Call, Plan
from crucible_sandbox.wire.channel import split_frames
from crucible_sandbox.wire.messages import RunResultData, RunStatusName, TestStatusName, TestVerdictData
from crucible_sandbox.wire.values import decode, short_repr

# A frame a run's process wrote: untrusted, so read with `dict.get` and exact type checks.
Frame = dict[str, Any]
_PRECEDENCE: list[RunStatusName] = [
    "sandbox_error",
    "syntax_error",
    "memory_exceeded",
    "output_exceeded",
    "timeout",
    "error",
    "failed",
    "passed",
]
_SURROGATE = re.compile("[\ud800-\udfff]")
MALFORMED = "the program wrote malformed data to the harness channel"


@dataclass
class ProcessOutcome:
    """How one process of a run ended and what it wrote."""

    frames: list[Frame] = field(default_factory=list)
    malformed: bool = False
    exit_code: int | None = None  # None when killed by a signal
    signal: int | None = None
    killed: str | None = None  # "timeout" | "output" | "report" | "memory": the run was ended
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    duration_ms: float = 0.0
    cell_timeout: int | None = None  # the cell the worker ended the run in, past its time (not a frame)

    @classmethod
    def of(
        cls, status: int, report: bytearray, killed: str | None, duration_ms: float, frames_at_most: int
    ) -> ProcessOutcome:
        """`frames_at_most`: how many frames the process writes when all is well."""
        frames, malformed = split_frames(report, frames_at_most)
        proc = cls(frames=[f for f in frames if isinstance(f, dict)], malformed=malformed, killed=killed)
        proc.malformed |= len(proc.frames) != len(frames)
        proc.duration_ms = duration_ms
        if os.WIFSIGNALED(status):
            proc.signal = None if killed else os.WTERMSIG(status)  # our SIGKILL, not the program's doing
        else:
            proc.exit_code = os.WEXITSTATUS(status)
        return proc

    @property
    def started(self) -> bool:
        return bool(self.frames) and self.frames[0].get("t") == "started"

    def first(self, *kinds: str) -> Frame | None:
        return next((f for f in self.frames[1:] if f.get("t") in kinds), None)

    def last(self, *kinds: str) -> Frame | None:
        return next((f for f in reversed(self.frames[1:]) if f.get("t") in kinds), None)


def worst(statuses: list[RunStatusName]) -> RunStatusName:
    """The overall status: the worst of the given ones, `passed` when empty.

    >>> worst(["passed", "failed", "timeout"])
    'timeout'
    """
    return min(statuses, key=_PRECEDENCE.index, default="passed")


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


def as_text(value: Any, limit: int = 4000) -> str | None:
    """`value` cut to `limit` characters if it is a string (a frame may hold anything), else None."""
    return value[:limit] if isinstance(value, str) else None


def ended_how(proc: ProcessOutcome) -> tuple[TestStatusName, str]:
    """(test status, message) for the test that was running when the process stopped."""
    if proc.killed == "timeout" or proc.signal == 24:  # SIGXCPU: CPU-time limit
        return "timeout", "time limit exceeded"
    if proc.killed == "output":
        return "error", "output limit exceeded"
    if proc.killed == "report":
        return "error", "the program wrote too much to the harness channel"
    if proc.killed == "memory":
        return "error", "memory limit exceeded (the run's processes together)"
    if proc.signal is not None:
        return "error", f"the process was killed by signal {proc.signal}"
    return "error", f"the process exited with status {proc.exit_code} before this test finished"


def process_status(proc: ProcessOutcome) -> RunStatusName | None:
    """The run status that how the process was ended implies, if any."""
    if proc.killed in ("output", "report"):
        return "output_exceeded"
    if proc.killed == "memory":
        return "memory_exceeded"
    if proc.killed == "timeout" or proc.signal == 24:
        return "timeout"
    # A SIGKILL we did not send and the kernel did not count as an OOM kill is the program's own.
    return None


def base(total: int, proc: ProcessOutcome) -> RunResultData:
    """A result before it is judged. Its status says `sandbox_error` until a verdict replaces it:
    a path that forgot to would answer an infrastructure fault, never a pass."""
    return {
        "status": "sandbox_error",
        "passed": 0,
        "total": total,
        "tests": [],
        "message": "",
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "output_truncated": proc.truncated,
        "duration_ms": round(proc.duration_ms, 3),
    }


def not_run(index: int, source: str, message: str = "") -> TestVerdictData:
    return {"index": index, "test": source, "status": "not_run", "message": message, "judged_outside": None}


def failure_message(
    source: str, op: str | None, actual: str, expected: str | None, why: str | None = None
) -> str:
    """One line saying what a failed assert saw.

    >>> failure_message("assert add(2, 2) == 4", "==", "5", "4")
    'assert add(2, 2) == 4 -> got 5'
    >>> failure_message("assert x < 3", "<", "7", "3")
    'assert x < 3 -> 7 < 3 is false'
    """
    if op is None or op == "==" or expected is None:
        text = f"{source} -> got {actual}"
    else:
        text = f"{source} -> {actual} {op} {expected} is false"
    return f"{text} ({why})" if why else text


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


def not_started(out: RunResultData, tests: list[str], proc: ProcessOutcome, who: str) -> RunResultData:
    status = process_status(proc)
    out["status"] = status or "sandbox_error"
    out["message"] = f"the {who} did not start"
    if status is None:
        out["message"] += (
            f" (exit status {proc.exit_code}, signal {proc.signal}); stderr: {proc.stderr[-300:]}"
        )
    out["tests"] = [not_run(i, s) for i, s in enumerate(tests)]
    return out


def _crashed(
    out: RunResultData, tests: list[str], crash: Frame, proc: ProcessOutcome, where: str
) -> RunResultData:
    out["status"] = worst(
        ["memory_exceeded" if crash.get("memory") is True else "error", process_status(proc) or "error"]
    )
    out["exception_type"] = as_text(crash.get("exc"), 100)
    out["message"] = f"{as_text(crash.get('msg'), 500) or 'error'} ({where})"
    out["traceback"] = as_text(crash.get("tb"))
    out["tests"] = [not_run(i, s, "the program failed before the tests ran") for i, s in enumerate(tests)]
    return out


def _finish(
    out: RunResultData, verdicts: list[TestVerdictData], proc: ProcessOutcome, extra: list[RunStatusName]
) -> RunResultData:
    statuses = [as_run_status(v["status"]) for v in verdicts] + extra
    if any(v.pop("memory", False) for v in verdicts):
        statuses.append("memory_exceeded")
    status = process_status(proc)
    if status:
        statuses.append(status)
    out["tests"] = verdicts
    out["passed"] = sum(v["status"] == "passed" for v in verdicts)
    out["status"] = worst(statuses)
    bad = next((v for v in verdicts if v["status"] != "passed"), None)
    if bad is not None:
        out["message"] = bad.get("message") or f"test {bad['index']} {bad['status']}"
    if proc.killed in ("output", "report"):
        out["message"] = ended_how(proc)[1]
    return out


_RUN_STATUS: dict[str, RunStatusName] = {
    "passed": "passed",
    "failed": "failed",
    "not_run": "failed",
    "error": "error",
    "timeout": "timeout",
}


def as_run_status(status: str) -> RunStatusName:
    """The run status a test's status counts as."""
    return _RUN_STATUS[status]


def _unfinished(
    tests: list[str],
    records: dict[int, Frame],
    done: bool,
    proc: ProcessOutcome,
    judge: Callable[[int, str, Frame], TestVerdictData],
) -> list[TestVerdictData]:
    """Verdicts in order: `judge(i, source, record)` for reported tests; for the first test without
    one, how the process ended (unless the run said it was done); `not_run` for the rest."""
    verdicts: list[TestVerdictData] = []
    stopped = False
    for i, source in enumerate(tests):
        rec = records.get(i)
        if rec is not None:
            verdicts.append(judge(i, source, rec))
        elif stopped or done:
            verdicts.append(not_run(i, source))
        else:
            status, message = ended_how(proc)
            verdicts.append(
                {"index": i, "test": source, "status": status, "message": message, "judged_outside": True}
            )
            stopped = True
    return verdicts


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
        return _crashed(out, plan.tests, crash, proc, "while loading the program")
    calls = plan.calls

    def judge(i: int, source: str, rec: Frame) -> TestVerdictData:
        return _judge_call(plan.sites[i].source, calls[i], i, source, rec)

    done = proc.first("done") is not None
    verdicts = _unfinished(plan.tests, records, done, proc, judge)
    out = _finish(out, verdicts, proc, ["error"] if proc.malformed else [])
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


def _raised(v: TestVerdictData, error: Frame) -> None:
    """Make `v` the error the test raised, as its error frame describes it."""
    v.update(
        {
            "status": "error",
            "exception_type": as_text(error.get("exc"), 100),
            "message": as_text(error.get("msg"), 500) or "error",
            "traceback": as_text(error.get("tb")),
            "memory": error.get("memory") is True,
        }
    )


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
        _raised(v, rec["error"])
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
        return _crashed(out, plan.tests, crash, program, "no function to test")
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
        return _crashed(out, plan.tests, setup, program, where)

    def verdict_of(i: int, source: str, rec: Frame) -> TestVerdictData:
        return _judge_record(plan, i, source, rec, program)

    done = judge.first("done") is not None
    verdicts = _unfinished(plan.tests, records, done, ended, verdict_of)
    extra: list[RunStatusName] = ["error"] if setup is not None else []
    return _finish(out, verdicts, program if program.killed else judge, extra)


def _program_failed(out: RunResultData, tests: list[str], program: ProcessOutcome) -> RunResultData:
    if not program.started:
        return not_started(out, tests, program, "harness")
    crash = program.first("crash")
    if crash is None:
        crash = {"exc": None, "msg": ended_how(program)[1]}
    return _crashed(out, tests, crash, program, "while loading the program")


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
        _raised(v, rec)
    elif status != "passed":
        v.update({"status": "error", "message": "the judge reported nothing usable for this test"})
    return v
