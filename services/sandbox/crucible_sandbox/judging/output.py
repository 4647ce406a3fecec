"""Trusted judgement of a program's output: stdin/stdout cases, and runs without tests.

This runs in the worker. A stdio case is its own process, and the worker compares what it wrote
to stdout with the expected output (`compare_output`). A run without tests passes when it ran to
its end and its process exited with status 0; the frames it wrote cannot decide that alone.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from crucible_sandbox.judging.verdict import (
    ProcessOutcome,
    as_run_status,
    as_text,
    base,
    ended_how,
    not_run,
    not_started,
    process_status,
    same_answer,
    worst,
)
from crucible_sandbox.wire.messages import (
    CellResultData,
    RunLimits,
    RunResultData,
    RunStatusName,
    StdioCase,
    TestVerdictData,
)
from crucible_sandbox.wire.values import short_repr

# -- stdin/stdout ---------------------------------------------------------------------------------

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


def judge_case(index: int, stdin: str, expected_output: str, proc: ProcessOutcome) -> TestVerdictData:
    """Verdict of one stdin/stdout case from its own process (the worker compares the output)."""
    verdict: TestVerdictData = {
        "index": index,
        "test": short_repr(stdin, 200),
        "status": "passed",
        "message": "",
        "judged_outside": True,
        "duration_ms": round(proc.duration_ms, 3),
    }
    status = process_status(proc)
    crash = proc.first("crash", "exit")
    if not proc.started and status is None:
        verdict.update(
            {"status": "sandbox_error", "message": f"the harness did not start; stderr: {proc.stderr[-300:]}"}
        )
    elif status == "timeout":
        verdict.update({"status": "timeout", "message": "time limit exceeded"})
    elif status == "output_exceeded":
        verdict.update({"status": "error", "message": ended_how(proc)[1]})
    elif status == "memory_exceeded" or (crash and crash.get("memory") is True):
        verdict.update({"status": "error", "message": "memory limit exceeded", "memory": True})
    elif crash is not None:
        message = (
            as_text(crash.get("msg"), 500)
            if crash.get("t") == "crash"
            else f"exit status {as_text(crash.get('code'), 200)}"
        )
        verdict.update(
            {
                "status": "error",
                "exception_type": as_text(crash.get("exc"), 100),
                "message": message or "error",
                "traceback": as_text(crash.get("tb")),
            }
        )
    elif proc.first("done") is None and (proc.exit_code != 0 or proc.signal is not None):
        verdict.update({"status": "error", "message": ended_how(proc)[1]})
    else:
        diff = compare_output(proc.stdout, expected_output)
        if diff:
            verdict.update(
                {
                    "status": "failed",
                    "message": diff,
                    "actual": short_repr(proc.stdout, 300),
                    "expected": short_repr(expected_output, 300),
                }
            )
    return verdict


def run_cases(
    cases: list[StdioCase], limits: RunLimits, run_case: Callable[[str, float], ProcessOutcome]
) -> RunResultData:
    """Run each case as its own process, `run_case(stdin, wall seconds)`, and judge the lot.

    The cases share the run's wall-time budget: each gets at most `test_time_s` of what is left,
    and once it is spent the remaining cases are reported as not run.
    """
    budget_end = time.monotonic() + limits["wall_time_s"]
    verdicts: list[TestVerdictData] = []
    procs: list[ProcessOutcome] = []
    for i, case in enumerate(cases):
        remaining = budget_end - time.monotonic()
        if remaining <= 0:
            verdicts.extend(
                not_run(j, c["input"][:200], "the run's time budget ran out")
                for j, c in enumerate(cases[i:], start=i)
            )
            break
        proc = run_case(case["input"], min(limits["test_time_s"], remaining))
        verdicts.append(judge_case(i, case["input"], case["output"], proc))
        procs.append(proc)
    return summarise_cases(verdicts, procs, len(cases), [c["output"] for c in cases])


def summarise_cases(
    verdicts: list[TestVerdictData], procs: list[ProcessOutcome], total: int, expected: list[str]
) -> RunResultData:
    """Run-level result for the stdio form."""
    shown = next(
        (p for v, p in zip(verdicts, procs, strict=False) if v["status"] != "passed"),
        procs[0] if procs else ProcessOutcome(),
    )
    out = base(total, shown)
    out["duration_ms"] = round(sum(p.duration_ms for p in procs), 3)
    statuses: list[RunStatusName] = []
    for v, p in zip(verdicts, procs, strict=False):
        if v["status"] == "sandbox_error":
            statuses.append("sandbox_error")
            v.update({"status": "error"})
            continue
        status = as_run_status(v["status"])
        if v.pop("memory", False):
            status = "memory_exceeded"
        elif process_status(p) == "output_exceeded":
            status = "output_exceeded"
        statuses.append(status)
    statuses += ["failed" for v in verdicts[len(procs) :]]
    out["tests"] = verdicts
    out["passed"] = sum(v["status"] == "passed" for v in verdicts)
    out["status"] = worst(statuses)
    out["same_answer"] = same_answer(
        [
            (normalise_output(p.stdout), normalise_output(want))
            for v, p, want in zip(verdicts, procs, expected, strict=False)
            if v["status"] in ("passed", "failed")
        ]
    )
    bad = next((v for v in verdicts if v["status"] != "passed"), None)
    if bad is not None:
        out["message"] = f"case {bad['index']}: {bad.get('message') or bad['status']}"
    return out


# -- programs without tests -----------------------------------------------------------------------


def judge_run(proc: ProcessOutcome) -> RunResultData:
    """Result of a program run without tests (`"kind": "run"`).

    `passed`: it ran to its end (or called `exit()` / `sys.exit(0)` / `os._exit(0)`) and its process
    exited with status 0; `error`: it raised, exited with another status or was killed; `timeout`,
    `memory_exceeded`, `output_exceeded` as ever.

    The program can write to the report channel itself, so a frame it forged must not decide
    the verdict: the *last* end frame counts (the harness writes its own after the program raised
    or exited) and `passed` also needs the process's own exit status 0 (a program that forges
    `done` and then kills itself or crashes the interpreter is an error).
    """
    out = base(0, proc)
    out["value"] = out["value_type"] = None
    status = process_status(proc)
    if not proc.started:
        return not_started(out, [], proc, "harness")
    end = proc.last("done", "crash", "exit")
    clean = proc.exit_code == 0 and proc.signal is None
    if status is not None:
        out.update({"status": status, "message": ended_how(proc)[1]})
    elif end is None and clean:
        out.update({"status": "passed", "message": "the program exited with status 0"})
    elif end is None or (end.get("t") == "done" and not clean):
        out.update({"status": "error", "message": ended_how(proc)[1]})
    elif end.get("t") == "done":
        out.update(
            {
                "status": "passed",
                "value": as_text(end.get("value"), 20_000),
                "value_type": as_text(end.get("value_type"), 100),
            }
        )
    elif end.get("t") == "exit":
        out.update(
            {"status": "error", "message": f"the program exited with status {as_text(end.get('code'), 200)}"}
        )
    else:
        out.update(
            {
                "status": "memory_exceeded" if end.get("memory") is True else "error",
                "exception_type": as_text(end.get("exc"), 100),
                "message": as_text(end.get("msg"), 500) or "error",
                "traceback": as_text(end.get("tb")),
            }
        )
    return out


def judge_cells(proc: ProcessOutcome, count: int) -> list[CellResultData]:
    """Each cell of a run with cells, from the frames its process wrote (untrusted: read as data),
    and the cell the worker ended the run in when one ran past its time (`cell_timeout`)."""
    frames = {f.get("i"): f for f in proc.frames if f.get("t") == "cell" and type(f.get("i")) is int}
    out: list[CellResultData] = []
    for i in range(count):
        frame = frames.get(i)
        cell: CellResultData = {
            "index": i,
            "status": "not_run",
            "stdout": "",
            "stderr": "",
            "value": None,
            "exception_type": None,
            "message": "",
            "traceback": None,
            "duration_ms": 0.0,
        }
        if proc.cell_timeout is not None and i >= proc.cell_timeout:
            # The worker ended the run in this cell (it ran past its time without reporting):
            # it timed out, the cells after it did not run, whatever frames claim otherwise.
            if i == proc.cell_timeout:
                cell.update({"status": "timeout", "message": "time limit exceeded"})
        elif frame is not None:
            error = frame.get("error")
            ms = frame.get("ms")
            cell.update(
                {
                    "status": "timeout" if frame.get("timeout") is True else "error" if error else "ok",
                    "stdout": as_text(frame.get("out"), 1 << 20) or "",
                    "stderr": as_text(frame.get("err"), 1 << 20) or "",
                    "value": as_text(frame.get("value"), 20_000),
                    "duration_ms": round(ms, 3) if type(ms) is float else 0.0,
                }
            )
            if cell["status"] == "timeout":
                cell["message"] = "time limit exceeded"
            elif isinstance(error, dict):
                cell["exception_type"] = as_text(error.get("exc"), 100)
                cell["message"] = as_text(error.get("msg"), 500) or "error"
                cell["traceback"] = as_text(error.get("tb"))
        out.append(cell)
    return out
