"""The judge: the process of a run that runs the tests and never the program.

Suites that are not plain calls on literals (see `judging.plan`) run here: `check` functions, asserts of
several statements, setup code, comparisons other than `==`. The judge is forked by the same
zygote as the program's process, confined the same way but as a uid of its own (the program can
neither signal it nor read its memory), and it receives only the compiled tests: the program's
code never enters it, and the expected values and the code computing them never leave it.

Names the tests take from the program resolve through the link (`link`): calls run in the
program's process, their results come back as data, and the checker compares them here, with the
judge's own builtins. A comparison that would need an object of the program (its `__eq__`, its
truth value) is not judged: the test fails and says so (`judged: false`). Per test the judge
reports its verdict, the values it saw, and the program's names other than the entry point that
the test used (`helpers`: a HumanEval `check` may rely on a helper the prompt defined, which the
program can redefine).
"""

from __future__ import annotations

import builtins
import operator
import os
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from crucible_sandbox.inrun import runtime
from crucible_sandbox.inrun.link import Link, NotJudged, ProgramLost
from crucible_sandbox.inrun.runtime import TestTimeout
from crucible_sandbox.wire.channel import read_spec, write_frame
from crucible_sandbox.wire.values import short_repr

if TYPE_CHECKING:
    from crucible_sandbox.wire.messages import JudgedTests, JudgeSpec, RunLimits

# The judge's own backstop, past the test's time: the program's timer fires first, and a
# program that does not answer by then is given up on.
GRACE_S = 0.25
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


class _Stop(BaseException):
    """The program is gone: no later test can run."""


_BUILTINS = frozenset(dir(builtins))


class ProgramNamespace(dict):
    """The tests' globals: names the tests do not define resolve to the program's, then builtins.

    A program may define a builtin's name: MBPP 126's function under test is `sum`. A test then
    means the program's only when it reads no other name of the program's (`assert sum(10, 15)
    == 6`); otherwise the builtin is one of the test's own checking functions (`assert len(f(x))
    == 2`), and a program's `len = lambda *a: 2` must not decide it. In a `check`, the function
    under test is `candidate`, and builtin names are always the builtins.
    """

    def __init__(self, link: Link, names: list[str], entry_point: str | None) -> None:
        super().__init__(__name__="__main__", __builtins__=builtins)
        self.link, self.names, self.entry_point = link, frozenset(names), entry_point
        self.used: set[str] = set()
        self.shadowing = False  # builtin names resolve to the program's

    def reading(self, names: list[str] | None) -> None:
        """The code about to run reads these names (None: unknown, as in a `check`)."""
        ours = self.names.intersection(names or ())
        self.shadowing = bool(ours) and ours <= _BUILTINS

    def __missing__(self, name: str) -> Any:
        if name not in self.names or (name in _BUILTINS and not self.shadowing):
            raise KeyError(name)  # a builtin, or a NameError
        value = self.link.request("global", name=name)
        # In a `check`, names other than the entry point are the program's helpers (with plain
        # asserts, every name the tests call is under test); a module the program imported is
        # the judge's own import of it, not the program's.
        if self.entry_point is not None and name != self.entry_point and type(value) is not types.ModuleType:
            self.used.add(name)
        return value


class Checker:
    """Receives every rewritten assert and the begin/ok/fail/end of every test."""

    def __init__(
        self,
        ops: list[str | None],
        report: int,
        link: Link,
        namespace: ProgramNamespace,
        test_time_s: float,
        deadline: float,
        names: list[list[str]] | None,
    ) -> None:
        self.ops, self.report, self.link, self.namespace, self.names = ops, report, link, namespace, names
        self.test_time_s, self.deadline = test_time_s, deadline
        self.record: dict[str, Any] = {}
        self.started = 0.0

    def begin(self, index: int) -> None:
        if self.link.lost:
            raise _Stop()
        # Not "passed" until `ok`: a test interrupted anywhere else never reads as passed.
        self.record = {"t": "test", "i": index, "status": "unfinished", "judged": True}
        self.namespace.used.clear()
        self.namespace.reading(self.names[index] if self.names else None)
        budget = min(self.test_time_s, self.deadline - runtime.now())
        self.started = time.perf_counter()
        self.link.deadline = runtime.now() + max(budget, 0.0)
        runtime.arm(max(budget, 0.001) + GRACE_S)

    def check(self, site_id: int, lhs: Any, rhs: Any) -> None:
        op = self.ops[site_id]
        left = lhs()
        if op is None:
            if not left:  # a program's object refuses its truth value (NotJudged)
                self._failed(site_id, left, None)
            return
        right = rhs()
        if not _OPS[op](left, right):
            self._failed(site_id, left, right)

    def ok(self, index: int) -> None:
        self.record["status"] = "passed"

    def _failed(self, site_id: int, left: Any, right: Any) -> None:
        self.record["fail"] = {
            "site": site_id,
            "actual": short_repr(left),
            "expected": None if right is None else short_repr(right),
        }
        raise _CheckFailed()

    def fail(self, index: int, exc: BaseException) -> None:
        runtime.disarm()
        rec = self.record
        if isinstance(exc, _CheckFailed):
            rec["status"] = "failed"
        elif isinstance(exc, NotJudged):
            rec.update(status="failed", judged=False, why=str(exc)[:300])
        elif isinstance(exc, TestTimeout):
            rec["status"] = "timeout"
        elif isinstance(exc, ProgramLost):
            rec.update(status="error", lost=self.link.lost or str(exc))
        else:
            rec.update(status="error", **error_info(exc))

    def end(self, index: int) -> None:
        runtime.disarm()
        rec = self.record
        if rec["status"] == "unfinished":  # interrupted between the test's end and `ok`
            rec.update(status="timeout" if self.link.lost is None else "error", lost=self.link.lost)
        rec["ms"] = (time.perf_counter() - self.started) * 1000
        rec["helpers"] = sorted(self.namespace.used)
        write_frame(self.report, rec)


def error_info(exc: BaseException) -> dict[str, Any]:
    """What the verdict says about an exception: the program's own, or one in the test code."""
    program = getattr(exc, "crucible_program", None)
    if isinstance(program, dict):
        return {**program, "program": True}
    return {**runtime.exception_info(exc), "program": False}


def judge_main(spec_fd: int, report_fd: int, confine: Callable[[RunLimits], None]) -> None:
    """Entry point of a run's judge, once forked; it may wait here for its run. Never returns."""
    _exit = os._exit
    got = read_spec(spec_fd)
    os.close(spec_fd)
    if got is None or not got[2]:
        _exit(3)
    spec, compiled, (link_fd, *_) = got
    # From the worker, which this process trusts.
    run, tests = cast("JudgeSpec", spec), cast("JudgedTests", compiled)
    write_frame(report_fd, {"t": "started"})
    confine(run["limits"])
    runtime.install_timer()
    deadline = runtime.now() + run["limits"]["wall_time_s"]
    runtime.SOURCES.update(tests["sources"])
    link = Link(link_fd)
    link.deadline = deadline
    try:
        _judge(link, tests, run["limits"], report_fd, deadline)
    except BaseException as exc:  # a fault of the judge's own: the worker reports a sandbox error
        write_frame(report_fd, {"t": "judge_error", **runtime.exception_info(exc)})
    link.end()
    for fd in (report_fd, link_fd):
        try:
            os.close(fd)
        except OSError:
            pass
    _exit(0)


def _judge(link: Link, tests: JudgedTests, limits: RunLimits, report: int, deadline: float) -> None:
    names = link.hello()
    if names is None:
        write_frame(report, {"t": "program_failed"})
        write_frame(report, {"t": "done"})
        return
    entry_point = tests.get("entry_point")
    namespace = ProgramNamespace(link, names, entry_point)
    for code, reads in ((tests["setup"], tests["setup_names"]), (tests["module"], None)):
        namespace.reading(reads)
        try:
            exec(code, namespace)
        except BaseException as exc:
            write_frame(report, {"t": "setup_error", **error_info(exc)})
            write_frame(report, {"t": "done"})
            return
    checker = Checker(tests["ops"], report, link, namespace, limits["test_time_s"], deadline, tests["names"])
    runner: Any = dict.get(namespace, tests["entry"])
    args: tuple[Any, ...] = (checker,)
    if entry_point is not None:
        try:
            args = (link.request("global", name=entry_point), checker)
        except KeyError:
            write_frame(report, {"t": "missing", "name": entry_point})
            write_frame(report, {"t": "done"})
            return
        except BaseException as exc:
            write_frame(report, {"t": "setup_error", **error_info(exc)})
            write_frame(report, {"t": "done"})
            return
    try:
        runner(*args)
    except _Stop:
        pass
    except BaseException as exc:  # outside any test (e.g. a statement after the last assert)
        runtime.disarm()
        write_frame(report, {"t": "setup_error", **error_info(exc)})
    write_frame(report, {"t": "done", "lost": link.lost})
