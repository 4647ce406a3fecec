"""How a run's processes ended, read from their wait statuses and their reports, and the parts
every verdict is built from.

A process's report is untrusted input: `ProcessOutcome.of` splits it into frames as far as they
parse (see `wire.channel.split_frames`) and keeps only those that are JSON objects; the verdicts
read them with `dict.get` and exact type checks. The first frame, `started`, is written before
any of the program runs, so a report without it means the sandbox failed (`sandbox_error`);
everything after it is the program's doing. A run's exit status and its stdout never decide
`passed`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from crucible_sandbox.wire.channel import split_frames
from crucible_sandbox.wire.messages import RunResultData, RunStatusName, TestStatusName, TestVerdictData

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


def crashed(
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


def finish(
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


def unfinished(
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
