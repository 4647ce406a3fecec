"""The part of the sandbox that runs *inside* a run's process, next to the candidate.

It is imported once by the zygote, so every forked run starts with it (and the usual stdlib
modules) already loaded. Order of events inside a run:

1. read the run spec from a pipe (it never sits in the zygote's memory); the worker has
   already planned and compiled the tests, so the run does no parsing of its own;
2. compile the candidate (a syntax error ends the run here);
3. *before any candidate code runs*, compute the expected value of every top-level
   `assert <expr> == <expected>` and send it to the worker; then drop the test code,
   so the candidate's process no longer holds what it would need to fake an answer;
4. run the candidate, the setup code and each test, reporting one frame per test.

Nothing here decides `passed`: the worker does, from these frames and its own plan.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import json
import linecache
import operator
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from types import CodeType
from typing import Any

from crucible_sandbox.channel import read_spec, write_frame
from crucible_sandbox.values import Unencodable, encode, short_repr

CANDIDATE = "<candidate>"
_HIDDEN_FILES = (__file__, os.path.join(os.path.dirname(__file__), "plan.py"), "<tests>", "<expected>")
# The candidate's source, for tracebacks: handed to `linecache` only when one is formatted.
_candidate_source = [""]

_OPS = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
    "is": operator.is_,
    "is not": operator.is_not,
}


class _CheckFailed(BaseException):
    """Raised by the checker to stop a test whose assert is false (as `assert` would)."""


class _TestTimeout(BaseException):
    """Raised by the per-test timer."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _TestTimeout()


def trimmed_traceback(exc: BaseException, limit_chars: int = 2000) -> str:
    """The traceback without the harness's own frames, capped in length."""
    source = _candidate_source[0]
    linecache.cache[CANDIDATE] = (len(source), None, source.splitlines(True), CANDIDATE)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename not in _HIDDEN_FILES]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
    lines.extend(traceback.format_exception_only(type(exc), exc))
    text = "".join(lines)
    return text if len(text) <= limit_chars else "...\n" + text[-limit_chars:]


def _exception_message(exc: BaseException) -> str:
    try:
        text = str(exc)
    except BaseException:
        text = ""
    name = type(exc).__name__
    return f"{name}: {text}"[:500] if text else name


def defined_by_candidate(value: Any) -> bool:
    """True when the value's type (or a base of it) has methods written by the candidate."""
    for cls in type(value).__mro__:
        for attr in vars(cls).values():
            code = getattr(attr, "__code__", None)
            if code is not None and code.co_filename == CANDIDATE:
                return True
    return False


def _encode_or_none(value: Any) -> Any:
    try:
        return encode(value)
    except Unencodable:
        return None
    except RecursionError:
        return None


class Checker:
    """Receives every rewritten assert and the begin/fail/end of every test."""

    def __init__(
        self, sites: list[tuple[str | None, bool]], report: int, test_time_s: float, deadline: float
    ) -> None:
        self.sites, self.report = sites, report
        self.test_time_s, self.deadline = test_time_s, deadline
        self.record: dict[str, Any] = {}
        self.started = 0.0

    # -- per test -------------------------------------------------------------------------
    def begin(self, index: int) -> None:
        self.record = {"t": "test", "i": index, "status": "passed", "actuals": {}}
        budget = min(self.test_time_s, self.deadline - time.monotonic())
        self.started = time.perf_counter()
        if budget <= 0:
            raise _TestTimeout()
        # Re-fires every 50 ms so a candidate that swallows one timeout still gets stopped.
        signal.setitimer(signal.ITIMER_REAL, budget, 0.05)

    def fail(self, index: int, exc: BaseException) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        rec = self.record
        if isinstance(exc, _CheckFailed):
            rec["status"] = "failed"
        elif isinstance(exc, _TestTimeout):
            rec["status"] = "timeout"
        else:
            rec["status"] = "error"
            rec["exc"] = type(exc).__name__
            rec["msg"] = _exception_message(exc)
            rec["tb"] = trimmed_traceback(exc)
            rec["memory"] = isinstance(exc, MemoryError)

    def end(self, index: int) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.record["ms"] = (time.perf_counter() - self.started) * 1000
        write_frame(self.report, self.record)

    # -- per assert -----------------------------------------------------------------------
    def check(self, site_id: int, lhs: Any, rhs: Any) -> None:
        op, trusted = self.sites[site_id]
        left = lhs()
        if trusted:
            # The worker holds the expected value; only the actual value leaves this process.
            enc = _encode_or_none(left)
            if enc is None:
                self.record["actuals"][str(site_id)] = {
                    "type": type(left).__qualname__,
                    "repr": short_repr(left),
                }
            else:
                self.record["actuals"][str(site_id)] = {"value": enc}
            return
        if op is None:
            if defined_by_candidate(left):
                self._failed(
                    site_id, left, None, "a value of a type defined by the program is not trusted as true"
                )
            if not left:
                self._failed(site_id, left, None, None)
            return
        right = rhs()
        if op in ("==", "!=", "<", "<=", ">", ">=") and (
            defined_by_candidate(left) or defined_by_candidate(right)
        ):
            self._failed(site_id, left, right, "values of types defined by the program are not compared")
        outcome = _OPS[op](left, right)
        if type(outcome) is not bool:
            outcome = bool(outcome)
        if not outcome:
            self._failed(site_id, left, right, None)

    def _failed(self, site_id: int, left: Any, right: Any, why: str | None) -> None:
        self.record["fail"] = {
            "site": site_id,
            "actual": short_repr(left),
            "expected": None if right is None else short_repr(right),
            "why": why,
        }
        raise _CheckFailed()


def _apply_limits(limits: dict[str, Any]) -> None:
    def cap(res: int, value: int) -> None:
        try:
            resource.setrlimit(res, (value, value))
        except (ValueError, OSError):
            pass  # cannot raise a hard limit: the lower existing one stays

    cap(resource.RLIMIT_CPU, int(limits["cpu_time_s"]) + 1)
    cap(resource.RLIMIT_AS, int(limits["memory_mb"]) << 20)
    cap(resource.RLIMIT_FSIZE, int(limits["file_bytes"]))
    cap(resource.RLIMIT_NOFILE, int(limits["open_files"]))
    cap(resource.RLIMIT_CORE, 0)
    if limits.get("processes"):
        cap(resource.RLIMIT_NPROC, int(limits["processes"]))


def child_main(spec_fd: int, report_fd: int, become_run_user: Callable[[], None]) -> None:
    """Entry point of a run's process, once confined; it may wait here, forked ahead of its run.

    `become_run_user` drops its privileges as soon as the spec is in. Never returns.
    """
    # Bound before any candidate code runs: a program that replaces `os._exit` cannot keep its
    # process alive past the end of its run.
    _exit = os._exit
    holder = [read_spec(spec_fd)]
    os.close(spec_fd)
    if holder[0] is None:
        _exit(3)
    become_run_user()
    spec = holder[0][0]
    deadline = time.monotonic() + spec["limits"]["wall_time_s"]
    signal.signal(signal.SIGALRM, _on_alarm)
    if spec.get("stdin") is not None:
        _feed_stdin(spec["stdin"])
    _apply_limits(spec["limits"])
    stdio = spec["kind"] == "stdio"
    del spec  # `_run_tests` drops the last reference once the expected values are out
    try:
        if stdio:
            _run_program(holder.pop()[0], report_fd)
        else:
            _run_tests(holder, report_fd, deadline)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    # Closing our ends first lets the worker see end-of-file, and answer, while this process is
    # still being torn down (its zygote reaps it and cleans up before the slot's next run).
    for fd in (1, 2, report_fd):
        with contextlib.suppress(OSError):
            os.close(fd)
    _exit(0)


def _report_exception(report_fd: int, kind: str, exc: BaseException) -> None:
    """Tell the zygote the program (or the test set-up) raised outside any test."""
    frame = {
        "t": kind,
        "exc": type(exc).__name__,
        "msg": _exception_message(exc),
        "tb": trimmed_traceback(exc),
    }
    frame["memory"] = isinstance(exc, MemoryError)
    write_frame(report_fd, frame)


def _feed_stdin(text: str) -> None:
    """Put the case's input behind fd 0 through an unlinked file (no pipe to fill up)."""
    path = ".stdin"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    fd = os.open(path, os.O_RDONLY)
    os.unlink(path)
    os.dup2(fd, 0)
    os.close(fd)


def compile_candidate(source: str) -> tuple[CodeType | None, dict[str, Any] | None]:
    """(code, None), or (None, the `syntax` frame) when the program does not compile.

    Called by the worker, so the run's process only loads the code object. Compiled as plain
    Python would (`dont_inherit`: none of this module's `__future__` imports apply).
    """
    try:
        return compile(source, CANDIDATE, "exec", dont_inherit=True), None
    except (SyntaxError, ValueError) as exc:  # ValueError: source contains null bytes
        frame = {
            "t": "syntax",
            "msg": _exception_message(exc),
            "tb": "".join(traceback.format_exception_only(type(exc), exc)),
        }
        return None, frame


def _run_program(spec: dict[str, Any], report_fd: int) -> None:
    """stdin/stdout form: the candidate is the whole program; the worker judges its output."""
    _candidate_source[0] = spec["source"]
    code = spec["program"]
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(code, namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            write_frame(report_fd, {"t": "exit", "code": str(exc.code)[:200]})
            return
    except BaseException as exc:
        _report_exception(report_fd, "crash", exc)
        return
    write_frame(report_fd, {"t": "done"})


def _expected_values(setup: Any, expected: dict[int, Any]) -> dict[str, Any]:
    """Phase 1: evaluate trusted right-hand sides before any candidate code has run."""
    scratch: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(setup, scratch)
    except BaseException:
        pass  # the setup may need the candidate; such sites fall back to in-process checks
    values: dict[str, Any] = {}
    for site_id, code in expected.items():
        try:
            values[str(site_id)] = encode(eval(code, scratch))
        except BaseException:
            values[str(site_id)] = None
    return values


def _run_tests(holder: list[Any], report_fd: int, deadline: float) -> None:
    spec, tests = holder.pop()
    _candidate_source[0] = spec["source"]
    code = spec["program"]
    expected = _expected_values(tests["setup"], tests["expected"])
    # A trusted site whose expected value could not be computed up front is checked in-process.
    distrust = frozenset(int(k) for k, v in expected.items() if v is None)
    sites, single = tests["sites"], tests.get("single")
    if distrust and single is not None:
        # Compared here, with its expected-value code as the right-hand side.
        sites = [(op, trusted and i not in distrust) for i, (op, trusted) in enumerate(sites)]
        single = [
            (lhs, tests["expected"][i] if i in distrust else rhs) for i, (lhs, rhs) in enumerate(single)
        ]
    elif distrust:
        # Instrumented code that keeps those right-hand sides: only now is anything parsed here
        # (no MBPP or HumanEval suite needs it). The zygote preloaded the planner: a run could not
        # import it from its confinement.
        from crucible_sandbox import plan as plan_mod

        plan = plan_mod.plan_asserts(json.loads(tests["asserts"]), distrust)
        tests["module"] = compile(plan.module, "<tests>", "exec", dont_inherit=True)
        sites = [(site.op, site.trusted) for site in plan.sites]
        del plan
    write_frame(report_fd, {"t": "expected", "values": expected})
    setup, entry, entry_point = tests["setup"], tests.get("entry"), tests["entry_point"]
    test_code = tests.get("module")
    test_time = spec["limits"]["test_time_s"]
    # The expected-value code and the test sources leave this process's reach.
    del spec, tests, expected
    gc.collect()

    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(code, namespace)
    except BaseException as exc:
        _report_exception(report_fd, "crash", exc)
        return
    try:
        exec(setup, namespace)
    except BaseException as exc:
        _report_exception(report_fd, "setup_error", exc)
        return
    checker = Checker(sites, report_fd, test_time, deadline)
    try:
        if single is not None:
            _run_single_asserts(single, namespace, checker)
        else:
            exec(test_code, namespace)
            runner = namespace[entry]
            if entry_point is None:
                runner(checker)
            else:
                if entry_point not in namespace:
                    write_frame(
                        report_fd,
                        {
                            "t": "crash",
                            "exc": "NameError",
                            "msg": f"NameError: the program does not define `{entry_point}`",
                            "tb": None,
                            "memory": False,
                        },
                    )
                    return
                runner(namespace[entry_point], checker)
    except BaseException as exc:
        # The tests failed outside any test (e.g. the time budget ran out between two).
        _report_exception(report_fd, "setup_error", exc)
        return
    write_frame(report_fd, {"t": "done"})


def _run_single_asserts(steps: list[tuple[Any, Any]], namespace: dict[str, Any], checker: Checker) -> None:
    """Tests that are one `assert` each, run as their instrumented form would run them.

    `steps[i]` is (left operand or whole test, right operand or None), compiled by the worker.
    """
    for i, (lhs, rhs) in enumerate(steps):
        checker.begin(i)
        try:
            checker.check(
                i,
                lambda lhs=lhs: eval(lhs, namespace),
                None if rhs is None else (lambda rhs=rhs: eval(rhs, namespace)),
            )
        except BaseException as exc:
            checker.fail(i, exc)
        finally:
            checker.end(i)
