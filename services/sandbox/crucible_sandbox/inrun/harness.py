"""The program's side of a run: the only process that runs the candidate's code.

It is forked by the zygote ahead of its run and waits for its spec (see `isolation.zygote`). The spec holds
the compiled program and, depending on the test form, what to do with it; it never holds a test's
expected value or the code that computes one:

* `calls`: the name and literal arguments of each test's call (see `judging.plan`): the process calls
  each, under the test's timer, and reports the value as data; the worker compares it;
* `judged`: nothing about the tests: the process serves the run's judge (see `judge`, `link`);
* `stdio`: one case's input; the worker compares the output;
* `run`: no tests: stdin, and optionally a final expression or a call whose value to report.

Before any of the program runs, the process writes a `started` frame: a report without it means
the sandbox failed, anything after it is the program's doing. Nothing here decides a verdict.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
import time
from collections.abc import Callable
from types import CodeType
from typing import TYPE_CHECKING, Any, cast

from crucible_sandbox.inrun import cells, command, runtime
from crucible_sandbox.inrun.link import ProgramServer
from crucible_sandbox.inrun.runtime import CANDIDATE, TestTimeout, exception_info
from crucible_sandbox.wire.channel import read_frame, read_spec, write_frame
from crucible_sandbox.wire.values import Unencodable, encode, short_repr

if TYPE_CHECKING:
    from crucible_sandbox.wire.messages import ProgramSpec, RunLimits

VALUE_CHARS = 10_000  # the longest repr reported for a run's value
_NOTHING = object()


def program_main(spec_fd: int, report_fd: int, confine: Callable[[RunLimits], None]) -> None:
    """Entry point of a run's program process, once forked; it may wait here. Never returns.

    `confine` applies the run's memory limit and drops the process's privileges.
    """
    # Bound before any candidate code runs: a program that replaces `os._exit` cannot keep its
    # process alive past the end of its run.
    _exit = os._exit
    got = read_spec(spec_fd)
    os.close(spec_fd)
    if got is None:
        _exit(3)
    spec, _, fds = got
    run = cast("ProgramSpec", spec)  # from the worker, which this process trusts
    write_frame(report_fd, {"t": "started"})
    confine(run["limits"])
    runtime.install_timer()
    deadline = runtime.now() + run["limits"]["wall_time_s"]
    runtime.SOURCES[CANDIDATE] = run["source"]
    sys.argv[:] = [CANDIDATE]  # as for `python -c`: no arguments (and not the zygote's)
    if run.get("stdin") is not None:
        _feed_stdin(run["stdin"])
    runtime.apply_limits(run["limits"], run["limits"].get("processes"), run["limits"].get("address_space_mb"))
    kind = run["kind"]
    if kind == "command":
        command.run_command(run, report_fd)  # never returns
    status = 0
    try:
        if kind == "calls":
            _run_calls(run, report_fd, deadline)
        elif kind == "judged":
            _serve(run, report_fd, fds[0])
        elif kind == "stdio":
            _run_stdio(run, report_fd)
        else:
            status = _run_only(run, report_fd)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    # Closing our ends first lets the worker see end-of-file, and answer, while this process is
    # still being torn down (its zygote reaps it and cleans up before the slot's next run).
    for fd in (1, 2, report_fd, *fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _exit(status)


def _feed_stdin(text: str) -> None:
    """Put the input behind fd 0 through an unlinked file (no pipe to fill up)."""
    path = ".stdin"
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    fd = os.open(path, os.O_RDONLY)
    os.unlink(path)
    os.dup2(fd, 0)
    os.close(fd)


def _load(run: ProgramSpec, report_fd: int, link_fd: int | None = None) -> dict[str, Any] | None:
    """Run the program's module; None (after a `crash` frame) if it raised."""
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(run["program"], namespace)
    except BaseException as exc:
        write_frame(report_fd, {"t": "crash", **exception_info(exc)})
        if link_fd is not None:
            with contextlib.suppress(OSError):
                write_frame(link_fd, {"t": "crash"})
        return None
    return namespace


def _run_calls(run: ProgramSpec, report_fd: int, deadline: float) -> None:
    """`calls` form: each test calls one function on literal arguments; its value is reported."""
    namespace = _load(run, report_fd)
    if namespace is None:
        return
    test_time = run["limits"]["test_time_s"]
    for i, (name, arguments) in enumerate(run["calls"]):
        record: dict[str, Any] = {"t": "test", "i": i}
        started = time.perf_counter()
        try:
            try:
                runtime.arm(min(test_time, deadline - runtime.now()))
                record.update(_call(namespace, name, arguments))
            finally:
                runtime.disarm()
        except TestTimeout:  # also one that fired late, while the record was being made
            record = {"t": "test", "i": i, "timeout": True}
        record["ms"] = (time.perf_counter() - started) * 1000
        write_frame(report_fd, record)
    write_frame(report_fd, {"t": "done"})


def _call(namespace: dict[str, Any], name: str, arguments: CodeType | None) -> dict[str, Any]:
    """One call of the program, and its value as data (or why there is none)."""
    try:
        if name not in namespace:
            raise NameError(f"name '{name}' is not defined")
        if arguments is None:  # a plan always compiles them (see `judging.plan._call`)
            raise TypeError("the call's arguments were not compiled")
        args, kwargs = eval(arguments, {"__builtins__": {}})  # literals only (see `judging.plan.Call`)
        value = namespace[name](*args, **kwargs)
    except TestTimeout:
        raise
    except BaseException as exc:
        return {"error": exception_info(exc)}
    try:
        return {"value": encode(value)}
    except Unencodable:
        return {"other": {"type": runtime.text(type(value).__qualname__, 100), "repr": short_repr(value)}}


def _serve(run: ProgramSpec, report_fd: int, link_fd: int) -> None:
    """`judged` form: load the program, then answer the judge's requests until it is done."""
    namespace = _load(run, report_fd, link_fd)
    if namespace is None:
        return
    server = ProgramServer(namespace)
    write_frame(link_fd, server.hello())
    while True:
        try:
            request = read_frame(link_fd)
        except (ValueError, RecursionError, OSError):
            break
        if not isinstance(request, dict) or request.get("op") == "end":
            break
        try:
            write_frame(link_fd, server.answer(request))
        except OSError:
            break
    write_frame(report_fd, {"t": "done"})


def _run_stdio(run: ProgramSpec, report_fd: int) -> None:
    """stdin/stdout form: the program is the whole program; the worker judges its output."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(run["program"], namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            write_frame(report_fd, {"t": "exit", "code": short_repr(exc.code, 200)})
            return
    except BaseException as exc:
        write_frame(report_fd, {"t": "crash", **exception_info(exc)})
        return
    write_frame(report_fd, {"t": "done"})


def _run_only(run: ProgramSpec, report_fd: int) -> int:
    """`run` form (no tests): run the program, then its final expression or the call asked for.

    Returns the exit status the process ends with, as the interpreter's would be: 0, the code of
    `sys.exit(n)`, 1 after an exception (or `sys.exit` with something else than a number).
    """
    command.write_files(run.get("files") or {})
    status = _run_program(run, report_fd)
    fetch = run.get("fetch")
    if fetch:
        with contextlib.suppress(BaseException):  # the program may have broken anything
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        write_frame(report_fd, {"t": "files", "files": command.read_files(fetch)})
    return status


def _run_program(run: ProgramSpec, report_fd: int) -> int:
    deadline = runtime.now() + run["limits"]["wall_time_s"]
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    value: Any = _NOTHING
    try:
        exec(run["program"], namespace)
        if run.get("cells"):
            limits = run["limits"]
            cells.run_cells(
                run["cells"], namespace, report_fd, limits["test_time_s"], deadline, limits["output_bytes"]
            )
        last, call = run.get("last"), run.get("call")
        if last is not None:
            value = eval(last, namespace)
        elif call is not None:
            name, args, kwargs = call
            if name not in namespace:
                raise NameError(f"name '{name}' is not defined")
            value = namespace[name](*args, **kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            write_frame(report_fd, {"t": "exit", "code": short_repr(exc.code, 200)})
            return exc.code & 0xFF if type(exc.code) is int else 1
    except BaseException as exc:
        write_frame(report_fd, {"t": "crash", **exception_info(exc)})
        return 1
    frame: dict[str, Any] = {"t": "done"}
    if value is not _NOTHING:
        frame["value"] = short_repr(value, VALUE_CHARS)
        frame["value_type"] = runtime.text(type(value).__qualname__, 100)
    write_frame(report_fd, frame)
    return 0
