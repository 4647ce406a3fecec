"""A worker slot: the trusted side of every run, next to its zygote.

The server starts one worker per slot and talks to it in length-prefixed JSON frames on
stdin/stdout, one run at a time. For each run the worker

1. compiles the candidate, plans the tests (`plan`) and compiles the test code, so the run's
   process does no parsing of its own (plans are cached: many samples of one problem share them);
2. writes the run's spec to the process its zygote forked ahead for it (see `zygote` for why
   forking lives in another process), then reads that process's report, stdout and stderr
   pipes concurrently, capping the output (past the cap it has the zygote kill the run);
3. judges the result from its own plan and what the run reported (`verdict`).

Usage (by the server): python -m crucible_sandbox.worker '<IsolationConfig as JSON>' [niceness [idle|batch|other]]
(a batch slot's niceness and scheduling policy are inherited by its zygote and every run it forks).
"""

from __future__ import annotations

import ast
import contextlib
import json
import marshal
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from types import CodeType
from typing import Any

from crucible_sandbox import verdict
from crucible_sandbox.channel import encode_frame, encode_spec, read_frame, split_frames, write_frame
from crucible_sandbox.harness import compile_candidate
from crucible_sandbox.plan import Plan, plan_asserts, plan_check, plan_single_asserts
from crucible_sandbox.zygote import DONE, DONE_MSG, KILL, RUN, RUN_MSG

_READ = 1 << 16
# How long to wait, after the zygote reported the run over (and its processes killed), for the
# last bytes in its pipes; and how long past the wall time before the zygote is declared stuck.
_DRAIN_S = 0.05
_ZYGOTE_GRACE_S = 10.0
_DONE_FRAME = encode_frame({"t": "done"})  # the harness's last frame
# Batch slots' scheduling policies. SCHED_IDLE: any normal process that wakes (the server, a
# single run's slot) preempts them at once. SCHED_BATCH: they never preempt anything on wake-up.
_POLICIES = {"idle": os.SCHED_IDLE, "batch": os.SCHED_BATCH}


class ZygoteLost(RuntimeError):
    """The zygote died or stopped answering; the worker exits and the server restarts the slot."""


def _expression(node: ast.expr) -> CodeType:
    return compile(ast.Expression(body=node), "<tests>", "eval", dont_inherit=True)


def compile_tests(tests: dict[str, Any]) -> tuple[Plan, dict[str, Any]]:
    """The trusted plan (kept here, for judging) and the compiled test code the run receives.

    Trusted sites' expected-value expressions are compiled on their own (the run evaluates them
    before any candidate code, then drops them); the code that runs the tests does not contain
    them. Suites of single asserts get each assert's operands compiled alone (see `plan`).
    """
    single = plan_single_asserts(tests["asserts"]) if tests["kind"] == "asserts" else None
    if single is not None:
        plan = single
    elif tests["kind"] == "asserts":
        plan = plan_asserts(tests["asserts"])
    else:
        plan = plan_check(tests["check"])
    program: dict[str, Any] = {
        "entry_point": tests.get("entry_point"),
        "setup": compile(tests.get("setup", ""), "<setup>", "exec", dont_inherit=True),
        "sites": [(site.op, site.trusted) for site in plan.sites],
        "expected": {
            i: compile(ast.Expression(body=site.rhs), "<expected>", "eval", dont_inherit=True)
            for i, site in enumerate(plan.sites)
            if site.trusted and site.rhs is not None
        },
    }
    if single is not None:
        # (left operand or whole test, right operand when it is checked in-process)
        program["single"] = [
            (
                _expression(site.lhs),
                _expression(site.rhs) if site.rhs is not None and not site.trusted else None,
            )
            for site in plan.sites
            if site.lhs is not None
        ]
    else:
        assert plan.module is not None
        program["module"] = compile(plan.module, "<tests>", "exec", dont_inherit=True)
        program["entry"] = plan.entry
        # Only needed when some expected value cannot be computed up front (see `harness`):
        # one string, not a list of them, so the run has one object fewer per test to load.
        program["asserts"] = json.dumps(tests.get("asserts"))
    return plan, program


class PlanCache:
    """LRU of compiled tests keyed by their JSON: RL batches run many samples of one problem."""

    def __init__(self, entries: int = 256) -> None:
        self.entries = entries
        self.data: OrderedDict[str, tuple[Plan, bytes]] = OrderedDict()

    def get(self, tests: dict[str, Any]) -> tuple[Plan, bytes]:
        key = json.dumps(tests, sort_keys=True)
        hit = self.data.get(key)
        if hit is not None:
            self.data.move_to_end(key)
            return hit
        plan, program = compile_tests(tests)
        value = (plan, marshal.dumps(program))
        self.data[key] = value
        if len(self.data) > self.entries:
            self.data.popitem(last=False)
        return value


class Worker:
    def __init__(self, config: dict[str, Any]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "crucible_sandbox.zygote", json.dumps(config), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # fd 1 of the worker is the server's channel
            env=os.environ.copy(),  # the worker's own environment is already minimal (see `pool`)
        )
        theirs.close()
        self.sock = ours
        message = ours.recv(1 << 16)
        if not message:
            raise ZygoteLost("the zygote did not start")
        self.info = json.loads(message)
        self.plans = PlanCache()
        self.prepared: list[int] | None = None  # the worker's ends of the next process's pipes
        self.awaiting_done = False
        self._done()  # the first prepared process
        self.selector = selectors.DefaultSelector()
        self.selector.register(ours, selectors.EVENT_READ)

    # -- one process ----------------------------------------------------------------------------
    def execute(self, spec: bytes, wall_s: float, output_cap: int) -> verdict.ProcessOutcome:
        """Run `spec` in the process the zygote prepared; collect what it writes until it is over."""
        if self.awaiting_done:  # the previous run's process is reaped and cleaned up first
            self._done()
        if self.prepared is None:
            raise ZygoteLost("the zygote has no process ready")
        spec_w, report_r, out_r, err_r = self.prepared
        self.prepared = None
        started = time.perf_counter()
        try:
            try:
                self.sock.send(RUN_MSG.pack(RUN, wall_s))
            except OSError as exc:
                raise ZygoteLost(f"cannot reach the zygote: {exc!r}") from None
            try:
                _write_all(spec_w, spec)
            except OSError:
                pass  # it died before reading its spec: seen below as a harness that did not start
            os.close(spec_w)
            spec_w = -1
            return self._collect(report_r, out_r, err_r, wall_s, output_cap, started)
        finally:
            for fd in (spec_w, report_r, out_r, err_r):
                if fd >= 0:
                    os.close(fd)

    def _collect(
        self, report_r: int, out_r: int, err_r: int, wall_s: float, output_cap: int, started: float
    ) -> verdict.ProcessOutcome:
        proc = verdict.ProcessOutcome()
        buffers = {report_r: bytearray(), out_r: bytearray(), err_r: bytearray()}
        sel = self.selector
        for fd in buffers:
            sel.register(fd, selectors.EVENT_READ)
        open_fds = set(buffers)
        output = 0
        done: tuple[int, bool] | None = None
        give_up = time.monotonic() + wall_s + _ZYGOTE_GRACE_S
        try:
            while open_fds or done is None:
                if not open_fds and not proc.killed and buffers[report_r].endswith(_DONE_FRAME):
                    # The harness is through and has closed its ends: answer now, while the
                    # process is torn down; its DONE is collected before the slot's next run.
                    self.awaiting_done = True
                    done = (0, False)
                    break
                timeout = give_up - time.monotonic()
                if timeout <= 0:
                    if done is None:
                        raise ZygoteLost("the zygote did not end a run past its wall time")
                    break  # a pipe still open after every process was killed: stop waiting
                for key, _ in sel.select(timeout):
                    fd = key.fd
                    if fd == self.sock.fileno():
                        done = self._done()
                        give_up = min(give_up, time.monotonic() + _DRAIN_S)
                        continue
                    data = os.read(fd, _READ)
                    if not data:
                        sel.unregister(fd)
                        open_fds.discard(fd)
                    elif fd == report_r:
                        buffers[fd] += data
                    else:
                        room = output_cap - output
                        output += len(data)
                        if room > 0:
                            buffers[fd] += data[:room]
                        if output > output_cap and not proc.killed:
                            proc.killed, proc.truncated = "output", True
                            if done is None:
                                self.sock.send(KILL)
        finally:
            for fd in open_fds:
                sel.unregister(fd)
        status, timed_out = done
        if timed_out:
            proc.killed = "timeout"
        proc.duration_ms = (time.perf_counter() - started) * 1000
        if os.WIFSIGNALED(status):
            proc.signal = os.WTERMSIG(status)
        else:
            proc.exit_code = os.WEXITSTATUS(status)
        if proc.killed:
            proc.signal = None  # our SIGKILL, not the program's doing
        try:
            proc.frames = split_frames(buffers[report_r])
        except (ValueError, UnicodeDecodeError):
            proc.frame_error = True
        proc.stdout = buffers[out_r].decode("utf-8", "replace")
        proc.stderr = buffers[err_r].decode("utf-8", "replace")
        return proc

    def _done(self) -> tuple[int, bool]:
        """The zygote's DONE: (wait status, timed out); keeps the next prepared process's pipes."""
        try:
            message, fds, _, _ = socket.recv_fds(self.sock, 64, 4)
        except OSError as exc:
            raise ZygoteLost(f"cannot reach the zygote: {exc!r}") from None
        if not message:
            raise ZygoteLost("the zygote exited")
        kind, status, timed_out = DONE_MSG.unpack(message)
        if kind != DONE or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            raise ZygoteLost(f"unexpected message from the zygote: {message!r}")
        self.prepared, self.awaiting_done = fds, False
        return status, timed_out

    # -- runs -----------------------------------------------------------------------------------
    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        limits = request["limits"]
        tests = request["tests"]
        # Compiled here, so a program that does not compile costs no process at all.
        code, syntax = compile_candidate(request["code"])
        if tests["kind"] == "stdio":
            return self._run_stdio(request, code, syntax)
        plan, program = self.plans.get(tests)
        if syntax is not None:
            return verdict.judge_tests(plan, verdict.ProcessOutcome(frames=[syntax]))
        run = {"source": request["code"], "program": code, "limits": limits, "kind": tests["kind"]}
        proc = self.execute(encode_spec(run, program), limits["wall_time_s"] + 0.05, limits["output_bytes"])
        return verdict.judge_tests(plan, proc)

    def _run_stdio(
        self, request: dict[str, Any], code: CodeType | None, syntax: dict[str, Any] | None
    ) -> dict[str, Any]:
        limits = request["limits"]
        cases = request["tests"]["cases"]
        if syntax is not None:
            return verdict.syntax_error_cases(cases, syntax)
        budget_end = time.monotonic() + limits["wall_time_s"]
        verdicts, procs = [], []
        for i, case in enumerate(cases):
            remaining = budget_end - time.monotonic()
            if remaining <= 0:
                verdicts.extend(
                    {
                        "index": j,
                        "test": c["input"][:200],
                        "status": "not_run",
                        "message": "the run's time budget ran out",
                    }
                    for j, c in enumerate(cases[i:], start=i)
                )
                break
            run = {
                "source": request["code"],
                "program": code,
                "limits": limits,
                "kind": "stdio",
                "stdin": case["input"],
            }
            proc = self.execute(
                encode_spec(run), min(limits["test_time_s"], remaining), limits["output_bytes"]
            )
            verdicts.append(verdict.judge_case(i, case["input"], case["output"], proc))
            procs.append(proc)
        return verdict.summarise_cases(verdicts, procs, len(cases))

    def serve(self) -> None:
        write_frame(1, {"ready": True, "pid": os.getpid(), **self.info})
        while True:
            request = read_frame(0)
            if request is None:
                break
            try:
                result = self.run(request)
            except ZygoteLost:
                raise  # the server sees this worker end, answers `sandbox_error` and restarts it
            except Exception as exc:  # a bug of ours: report it as an infrastructure fault
                result = {
                    "status": "sandbox_error",
                    "passed": 0,
                    "total": 0,
                    "message": f"worker error: {exc!r}",
                }
            write_frame(1, result)

    def close(self) -> None:
        self.sock.close()  # the zygote ends its run (if any) and exits on end of stream
        try:
            self.zygote.wait(2)
        except subprocess.TimeoutExpired:
            self.zygote.kill()
            self.zygote.wait()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server owns shutdown: it closes our stdin
    if len(sys.argv) > 2 and int(sys.argv[2]):
        os.nice(int(sys.argv[2]))
    policy = _POLICIES.get(sys.argv[3]) if len(sys.argv) > 3 else None
    if policy is not None:
        with contextlib.suppress(OSError):  # not permitted here: the niceness alone stays
            os.sched_setscheduler(0, policy, os.sched_param(0))
    worker = Worker(json.loads(sys.argv[1]))
    try:
        worker.serve()
    finally:
        worker.close()


if __name__ == "__main__":
    main()
