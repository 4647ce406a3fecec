"""Trusted judgement: turn what a run's process reported, and how it ended, into a `RunResult`.

This runs in the zygote, outside the candidate's process. Frames sent after the candidate
started are treated as untrusted input: malformed ones are ignored, and for every top-level
`assert <expr> == <expected>` the expected value comes from the frame sent *before* the
candidate ran, the actual value is rebuilt from plain types, and `==` is evaluated here.
A run's exit status and its stdout never decide `passed`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from crucible_sandbox.plan import Plan
from crucible_sandbox.values import decode, short_repr

_PRECEDENCE = [
    "sandbox_error",
    "syntax_error",
    "memory_exceeded",
    "output_exceeded",
    "timeout",
    "error",
    "failed",
    "passed",
]


@dataclass
class ProcessOutcome:
    """How one run's process ended and what it wrote."""

    frames: list[Any] = field(default_factory=list)
    frame_error: bool = False
    exit_code: int | None = None  # None when killed by a signal
    signal: int | None = None
    killed: str | None = None  # "timeout" | "output" when the zygote killed it
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    duration_ms: float = 0.0


def worst(statuses: list[str]) -> str:
    """The overall status: the worst of the given ones, `passed` when empty.

    >>> worst(["passed", "failed", "timeout"])
    'timeout'
    """
    return min(statuses, key=_PRECEDENCE.index, default="passed")


def _ended_how(proc: ProcessOutcome) -> tuple[str, str]:
    """(test status, message) for the test that was running when the process stopped."""
    if proc.killed == "timeout" or proc.signal == 24:  # SIGXCPU: CPU-time limit
        return "timeout", "time limit exceeded"
    if proc.killed == "output":
        return "error", "output limit exceeded"
    if proc.signal is not None:
        return "error", f"the process was killed by signal {proc.signal}"
    return "error", f"the process exited with status {proc.exit_code} before this test finished"


def _process_status(proc: ProcessOutcome) -> str | None:
    if proc.killed == "output":
        return "output_exceeded"
    if proc.killed == "timeout" or proc.signal == 24:
        return "timeout"
    # A SIGKILL we did not send is not assumed to be the OOM killer: the address-space limit
    # turns memory exhaustion into MemoryError, and a program can SIGKILL itself.
    return None


def _base(total: int, proc: ProcessOutcome) -> dict[str, Any]:
    return {
        "passed": 0,
        "total": total,
        "tests": [],
        "message": "",
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "output_truncated": proc.truncated,
        "duration_ms": round(proc.duration_ms, 3),
    }


def _not_run(index: int, source: str, message: str = "") -> dict[str, Any]:
    return {"index": index, "test": source, "status": "not_run", "message": message}


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


def judge_tests(plan: Plan, proc: ProcessOutcome) -> dict[str, Any]:
    """Verdict for the `asserts` and `check` forms."""
    n = len(plan.tests)
    out = _base(n, proc)
    frames = [f for f in proc.frames if isinstance(f, dict)]
    first = frames[0] if frames else None

    if first and first.get("t") == "syntax":
        out["status"] = "syntax_error"
        out["message"] = str(first.get("msg", "syntax error"))
        out["traceback"] = first.get("tb")
        out["exception_type"] = "SyntaxError"
        out["tests"] = [_not_run(i, s) for i, s in enumerate(plan.tests)]
        return out
    if not first or first.get("t") != "expected" or not isinstance(first.get("values"), dict):
        status = _process_status(proc)
        out["status"] = status or "sandbox_error"
        out["message"] = (
            "the test suite's own set-up ran out of time"
            if status == "timeout"
            else "the harness did not start"
        )
        if status is None:
            out["message"] += (
                f" (exit status {proc.exit_code}, signal {proc.signal}); stderr: {proc.stderr[-300:]}"
            )
        out["tests"] = [_not_run(i, s) for i, s in enumerate(plan.tests)]
        return out

    expected: dict[int, Any] = {}
    for key, value in first["values"].items():
        site = int(key)
        if value is not None and 0 <= site < len(plan.sites) and plan.sites[site].trusted:
            expected[site] = value

    records: dict[int, dict[str, Any]] = {}
    crash: dict[str, Any] | None = None
    done = False
    for frame in frames[1:]:
        kind = frame.get("t")
        if kind == "test" and isinstance(frame.get("i"), int) and 0 <= frame["i"] < n:
            records.setdefault(frame["i"], frame)
        elif kind in ("crash", "setup_error") and crash is None:
            crash = frame
        elif kind == "done":
            done = True

    statuses: list[str] = []
    if crash is not None and not records:
        memory = bool(crash.get("memory"))
        where = "while loading the program" if crash.get("t") == "crash" else "in the test set-up"
        out["status"] = "memory_exceeded" if memory else "error"
        out["exception_type"] = _text(crash.get("exc"))
        out["message"] = f"{_text(crash.get('msg'))} ({where})"
        out["traceback"] = _text(crash.get("tb"))
        out["tests"] = [
            _not_run(i, s, "the program failed before the tests ran") for i, s in enumerate(plan.tests)
        ]
        proc_status = _process_status(proc)
        out["status"] = worst([out["status"], proc_status] if proc_status else [out["status"]])
        return out

    verdicts: list[dict[str, Any]] = []
    stopped = False
    for i, source in enumerate(plan.tests):
        rec = records.get(i)
        if rec is None:
            if stopped or done:
                verdicts.append(_not_run(i, source))
                continue
            status, message = _ended_how(proc)
            verdicts.append({"index": i, "test": source, "status": status, "message": message})
            stopped = True
            continue
        verdicts.append(_judge_one(plan, i, source, rec, expected))
    for v in verdicts:
        statuses.append(v["status"])
    out["tests"] = verdicts
    out["passed"] = sum(v["status"] == "passed" for v in verdicts)

    run_statuses = [_map_test_status(s) for s in statuses]
    if any(v.get("memory") for v in verdicts):
        run_statuses.append("memory_exceeded")
    if proc.frame_error:
        run_statuses.append("error")
    proc_status = _process_status(proc)
    if proc_status:
        run_statuses.append(proc_status)
    out["status"] = worst(run_statuses)
    bad = next((v for v in verdicts if v["status"] != "passed"), None)
    if bad is not None:
        out["message"] = bad.get("message") or f"test {bad['index']} {bad['status']}"
    if proc.frame_error:
        out["message"] = "the program wrote malformed data to the harness channel"
    for v in verdicts:
        v.pop("memory", None)
    return out


def _map_test_status(status: str) -> str:
    return {
        "passed": "passed",
        "failed": "failed",
        "not_run": "failed",
        "error": "error",
        "timeout": "timeout",
    }[status]


def _text(value: Any, limit: int = 4000) -> str | None:
    return None if value is None else str(value)[:limit]


def _judge_one(
    plan: Plan, index: int, source: str, rec: dict[str, Any], expected: dict[int, Any]
) -> dict[str, Any]:
    claimed = rec.get("status")
    verdict: dict[str, Any] = {"index": index, "test": source, "status": "passed", "message": ""}
    ms = rec.get("ms")
    verdict["duration_ms"] = round(float(ms), 3) if isinstance(ms, int | float) else 0.0
    if claimed == "error":
        verdict.update(
            status="error",
            exception_type=_text(rec.get("exc")),
            message=_text(rec.get("msg"), 500) or "error",
            traceback=_text(rec.get("tb")),
            memory=bool(rec.get("memory")),
        )
        return verdict
    if claimed == "timeout":
        verdict.update(status="timeout", message="time limit exceeded")
        return verdict
    if claimed not in ("passed", "failed"):
        verdict.update(status="error", message="the harness reported nothing usable for this test")
        return verdict

    # Trusted sites: judged here, whatever the run's process claimed.
    actuals = rec.get("actuals") if isinstance(rec.get("actuals"), dict) else {}
    for site_id, site in enumerate(plan.sites):
        if plan.site_test[site_id] != index or site_id not in expected:
            continue
        want = decode(expected[site_id])
        got = actuals.get(str(site_id))
        if not isinstance(got, dict):
            verdict.update(status="failed", message=f"{site.source} -> the assert was never evaluated")
            return verdict
        if "value" in got:
            try:
                value = decode(got["value"])
                equal = value == want
            except (ValueError, RecursionError, TypeError):
                verdict.update(
                    status="error", message="the program wrote malformed data to the harness channel"
                )
                return verdict
            if not (type(equal) is bool and equal):
                actual_repr, expected_repr = short_repr(value), short_repr(want)
                verdict.update(
                    status="failed",
                    actual=actual_repr,
                    expected=expected_repr,
                    message=failure_message(site.source, "==", actual_repr, expected_repr),
                )
                return verdict
        else:
            type_name, actual_repr = _text(got.get("type"), 100), _text(got.get("repr"), 300)
            verdict.update(
                status="failed",
                actual=actual_repr,
                expected=short_repr(want),
                message=failure_message(
                    site.source,
                    "==",
                    str(actual_repr),
                    None,
                    f"a {type_name} is not compared with the expected value",
                ),
            )
            return verdict

    if claimed == "failed":
        fail = rec.get("fail") if isinstance(rec.get("fail"), dict) else {}
        site_id = fail.get("site")
        site = plan.sites[site_id] if isinstance(site_id, int) and 0 <= site_id < len(plan.sites) else None
        actual, exp = _text(fail.get("actual"), 300), _text(fail.get("expected"), 300)
        verdict.update(status="failed", actual=actual, expected=exp)
        verdict["message"] = (
            failure_message(site.source, site.op, str(actual), exp, _text(fail.get("why"), 200))
            if site
            else "assertion failed"
        )
    return verdict


_WS = re.compile(r"[ \t\r\f\v]+")


def normalise_output(text: str) -> list[str]:
    """Lines with runs of whitespace collapsed and trailing whitespace and blank lines dropped.

    >>> normalise_output("1  2 \\n3\\n\\n")
    ['1 2', '3']
    """
    lines = [_WS.sub(" ", line).strip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def compare_output(actual: str, expected: str) -> str | None:
    """None when the outputs match, else one line saying where they differ.

    A prefix of the expected output does not match:

    >>> compare_output("1\\n", "1\\n2\\n")
    'output ended after 1 line(s); expected 2'
    >>> compare_output("1 2\\n", "1  2")
    """
    got, want = normalise_output(actual), normalise_output(expected)
    for lineno, (g, w) in enumerate(zip(got, want, strict=False), start=1):
        if g != w:
            return f"line {lineno}: expected {short_repr(w, 120)}, got {short_repr(g, 120)}"
    if len(got) < len(want):
        return f"output ended after {len(got)} line(s); expected {len(want)}"
    if len(got) > len(want):
        return f"{len(got) - len(want)} extra line(s) after the expected output"
    return None


def judge_case(index: int, stdin: str, expected_output: str, proc: ProcessOutcome) -> dict[str, Any]:
    """Verdict of one stdin/stdout case from its own process."""
    verdict: dict[str, Any] = {
        "index": index,
        "test": short_repr(stdin, 200),
        "status": "passed",
        "message": "",
        "duration_ms": round(proc.duration_ms, 3),
    }
    frames = [f for f in proc.frames if isinstance(f, dict)]
    kinds = {f.get("t") for f in frames}
    proc_status = _process_status(proc)
    crash = next((f for f in frames if f.get("t") in ("crash", "exit")), None)
    if proc_status == "timeout":
        verdict.update(status="timeout", message="time limit exceeded")
    elif proc_status == "output_exceeded":
        verdict.update(status="error", message="output limit exceeded")
    elif proc_status == "memory_exceeded" or (crash and crash.get("memory")):
        verdict.update(status="error", message="memory limit exceeded", memory=True)
    elif crash is not None:
        message = (
            _text(crash.get("msg"), 500) if crash.get("t") == "crash" else f"exit status {crash.get('code')}"
        )
        verdict.update(
            status="error",
            exception_type=_text(crash.get("exc")),
            message=message,
            traceback=_text(crash.get("tb")),
        )
    elif "done" not in kinds and (proc.exit_code != 0 or proc.signal is not None):
        verdict.update(status="error", message=_ended_how(proc)[1])
    else:
        diff = compare_output(proc.stdout, expected_output)
        if diff:
            verdict.update(
                status="failed",
                message=diff,
                actual=short_repr(proc.stdout, 300),
                expected=short_repr(expected_output, 300),
            )
    return verdict


def syntax_error_cases(cases: list[dict[str, Any]], syntax: dict[str, Any]) -> dict[str, Any]:
    """Run-level result for a stdio program that does not compile (no case ran)."""
    out = _base(len(cases), ProcessOutcome())
    out.update(
        status="syntax_error",
        message=str(syntax.get("msg")),
        traceback=syntax.get("tb"),
        exception_type="SyntaxError",
        tests=[_not_run(j, c["input"][:200]) for j, c in enumerate(cases)],
    )
    return out


def summarise_cases(
    verdicts: list[dict[str, Any]], procs: list[ProcessOutcome], total: int
) -> dict[str, Any]:
    """Run-level result for the stdio form."""
    shown = next(
        (p for v, p in zip(verdicts, procs, strict=False) if v["status"] != "passed"),
        procs[0] if procs else ProcessOutcome(),
    )
    out = _base(total, shown)
    out["duration_ms"] = round(sum(p.duration_ms for p in procs), 3)
    statuses = []
    for v, p in zip(verdicts, procs, strict=False):
        status = _map_test_status(v["status"])
        if v.pop("memory", False):
            status = "memory_exceeded"
        elif _process_status(p) == "output_exceeded":
            status = "output_exceeded"
        statuses.append(status)
    statuses += ["failed" for v in verdicts[len(procs) :]]
    out["tests"] = verdicts
    out["passed"] = sum(v["status"] == "passed" for v in verdicts)
    out["status"] = worst(statuses)
    bad = next((v for v in verdicts if v["status"] != "passed"), None)
    if bad is not None:
        out["message"] = f"case {bad['index']}: {bad.get('message') or bad['status']}"
    return out
