"""A worker slot: the trusted side of every run, next to its zygote.

The server starts one worker per slot and talks to it in length-prefixed JSON frames on
stdin/stdout, one run at a time. For each run the worker

1. compiles the candidate and plans the tests (`compile`, `plan`; plans are cached: many samples
   of one problem share them), so the run's processes do no parsing of their own;
2. sends the specs to the processes its zygote forked ahead for the run (see `isolation.zygote`
   for why forking lives in another process): the program's gets the program and, for a call
   plan, each test's call; the judge's, when the plan needs one, gets the compiled tests and the
   program's end of a socket pair to the program (see `inrun.link`); then it reads the processes'
   reports, stdout and stderr concurrently, capping the output and the reports (past a cap it has
   the zygote end the run);
3. judges the result from its own plan and what the run reported (`verdict`, `output`).

Usage (by the server): python -m crucible_sandbox.judging.worker '<SlotConfig as JSON>' [niceness
[idle|batch|other]] (a batch slot's niceness and scheduling policy are inherited by its zygote and
every run it forks).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import CodeType
from typing import cast

from crucible_sandbox.isolation import cgroups
from crucible_sandbox.isolation.zygote import DONE, DONE_MSG, JUDGE_FDS, KILL, PROGRAM_FDS, RUN, RUN_MSG
from crucible_sandbox.judging import compiled as compiled_runs
from crucible_sandbox.judging import output, verdict
from crucible_sandbox.judging.artifacts import Artifacts
from crucible_sandbox.judging.cell_clock import CellClock
from crucible_sandbox.judging.compile import (
    PlanCache,
    SyntaxFrame,
    compile_candidate,
    compile_cells,
    split_last_expression,
)
from crucible_sandbox.judging.verdict import ProcessOutcome
from crucible_sandbox.wire.channel import encode_frame, read_frame, send_spec, write_frame
from crucible_sandbox.wire.messages import (
    JudgeSpec,
    PreparedRun,
    ProgramSpec,
    RunLimits,
    RunOnly,
    RunResultData,
    SlotConfig,
    SlotInfo,
    StdioTests,
    ZygoteInfo,
)

_READ = 1 << 16
# How long to wait, after the zygote reported the run over (and its processes killed), for the
# last bytes in its pipes; and how long past the wall time before the zygote is declared stuck.
_DRAIN_S = 0.05
_ZYGOTE_GRACE_S = 10.0
_JUDGE_ERR = 8192  # what is kept of the judge's stderr (for a fault of the sandbox's own)
# The last frame of a run's lead process, when nothing went wrong: the worker answers as soon as
# it has arrived and every pipe is closed, while the zygote still tears the run down.
_PROGRAM_DONE = encode_frame({"t": "done"})
_JUDGE_DONE = encode_frame({"t": "done", "lost": None})
# Batch slots' scheduling policies. SCHED_IDLE: any normal process that wakes (the server, a
# single run's slot) preempts them at once. SCHED_BATCH: they never preempt anything on wake-up.
_POLICIES = {"idle": os.SCHED_IDLE, "batch": os.SCHED_BATCH}


class ZygoteLost(RuntimeError):
    """The zygote died or stopped answering; the worker exits and the server restarts the slot."""


class _Stream:
    """One pipe of a run being read: what was kept of it, and how much came."""

    def __init__(self, fd: int, role: str) -> None:
        self.fd, self.role, self.data, self.size = fd, role, bytearray(), 0


class Worker:
    def __init__(self, config: SlotConfig) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.zygote = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "crucible_sandbox.isolation.zygote",
                json.dumps(config),
                str(theirs.fileno()),
            ],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # fd 1 of the worker is the server's channel
            env=os.environ.copy(),  # the worker's own environment is already minimal (see `server.pool`)
        )
        theirs.close()
        self.sock = ours
        message = ours.recv(1 << 16)
        if not message:
            raise ZygoteLost("the zygote did not start")
        self.info: ZygoteInfo = json.loads(message)
        self.oom = cgroups.OomCounter(self.info["oom_file"]) if self.info.get("oom_file") else None
        self.plans = PlanCache()
        self.artifacts = Artifacts(config["work_root"])
        self.program: list[int] | None = None  # the worker's ends of the next program process's pipes
        self.judge: list[int] | None = None  # ... and of the next judge's
        self.awaiting_done = False
        self._done()  # the first prepared processes
        self.selector = selectors.DefaultSelector()
        self.selector.register(ours, selectors.EVENT_READ)

    # -- one run's processes ---------------------------------------------------------------------
    def execute(
        self,
        program: ProgramSpec,
        judge: tuple[JudgeSpec, bytes] | None,
        wall_s: float,
        caps: tuple[int, int],
        tests: int = 0,
        cells: CellClock | None = None,
    ) -> tuple[ProcessOutcome, ProcessOutcome | None]:
        """Run the prepared processes with these specs; collect what they write until they are over.

        `caps`: (output bytes, report bytes); `tests`: how many the run has; `cells`: the clock of
        a run with cells (the run is ended when a cell has not reported in its time). Returns the
        program's outcome and the judge's.
        """
        if self.awaiting_done:  # the previous run's processes are reaped and cleaned up first
            self._done()
        if self.program is None or (judge is not None and self.judge is None):
            raise ZygoteLost("the zygote has no process ready")
        program_fds, self.program = self.program, None
        judge_fds: list[int] = []
        if judge is not None:
            judge_fds, self.judge = self.judge or [], None
        started = time.perf_counter()
        try:
            try:
                memory = int(program["limits"]["memory_mb"])
                self.sock.send(RUN_MSG.pack(RUN, wall_s, judge is not None, memory))
            except OSError as exc:
                raise ZygoteLost(f"cannot reach the zygote: {exc!r}") from None
            self._send_specs(program, program_fds[0], judge, judge_fds[0] if judge_fds else -1)
            streams = [
                _Stream(program_fds[1], "report"),
                _Stream(program_fds[2], "out"),
                _Stream(program_fds[3], "err"),
            ]
            if judge_fds:
                streams += [_Stream(judge_fds[1], "judge"), _Stream(judge_fds[2], "judge_err")]
            # A run without tests is judged from the program's own frames: answer only once its
            # real exit status is known (it could write the final frame itself, then crash).
            exit_known = program["kind"] in ("run", "command")
            return self._collect(
                streams, wall_s, caps, started, judge is not None, tests + 8, exit_known, cells
            )
        finally:
            for fd in [*program_fds, *judge_fds]:
                with contextlib.suppress(OSError):
                    os.close(fd)

    @staticmethod
    def _send_specs(
        program: ProgramSpec, program_fd: int, judge: tuple[JudgeSpec, bytes] | None, judge_fd: int
    ) -> None:
        # A process that died before reading its spec is seen below as a harness that did not start.
        if judge is None:
            with contextlib.suppress(OSError):
                send_spec(program_fd, program)
            return
        link = [s.detach() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)]
        try:
            with contextlib.suppress(OSError):
                send_spec(program_fd, program, fds=(link[0],))
            with contextlib.suppress(OSError):
                send_spec(judge_fd, judge[0], judge[1], fds=(link[1],))
        finally:
            for fd in link:
                os.close(fd)

    def _collect(
        self,
        streams: list[_Stream],
        wall_s: float,
        caps: tuple[int, int],
        started: float,
        judged: bool,
        frames: int,
        exit_known: bool = False,
        cells: CellClock | None = None,
    ) -> tuple[ProcessOutcome, ProcessOutcome | None]:
        output_cap, report_cap = caps
        by_fd = {s.fd: s for s in streams}
        roles = {s.role: s for s in streams}
        lead, finished = (roles["judge"], _JUDGE_DONE) if judged else (roles["report"], _PROGRAM_DONE)
        sel = self.selector
        for fd in by_fd:
            sel.register(fd, selectors.EVENT_READ)
        open_fds = set(by_fd)
        output = 0
        killed: str | None = None
        done: tuple[int, int, bool, bool] | None = None
        cell_timeout: int | None = None  # the cell in progress when its clock ran out
        give_up = time.monotonic() + wall_s + _ZYGOTE_GRACE_S
        try:
            while open_fds or done is None:
                if not open_fds and not killed and not exit_known and lead.data.endswith(finished):
                    # The run is through and its processes have closed their ends: answer now,
                    # while they are torn down; the DONE is collected before the slot's next run.
                    self.awaiting_done = True
                    done = (0, 0, False, False)
                    break
                now = time.monotonic()
                if cells is not None and done is None and not killed and cells.expired(now):
                    # A cell that did not report in its time (it may have turned its own timer
                    # off): end the whole run from here, as its process cannot be trusted to.
                    killed, cell_timeout = "timeout", cells.pending
                    self.sock.send(KILL)
                timeout = give_up - now
                if cells is not None and done is None and not killed:
                    timeout = min(timeout, cells.deadline - now)
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
                    stream = by_fd[fd]
                    if not data:
                        sel.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    stream.size += len(data)
                    if stream.role in ("out", "err"):
                        room = output_cap - output
                        output += len(data)
                        if room > 0:
                            stream.data += data[:room]
                        over = output > output_cap and "output"
                    elif stream.role == "judge_err":
                        stream.data += data[: max(0, _JUDGE_ERR - len(stream.data))]
                        over = False
                    else:
                        stream.data += data[: max(0, report_cap - len(stream.data))]
                        over = stream.size > report_cap and "report"
                        if cells is not None and stream.role == "report":
                            cells.feed(stream.data, time.monotonic())
                    if over and not killed:
                        killed = over
                        if done is None:
                            self.sock.send(KILL)
        finally:
            for fd in open_fds:
                sel.unregister(fd)
        program_status, judge_status, timed_out, oom = done
        oom = (self.oom is not None and self.oom.grew()) or oom
        duration = (time.perf_counter() - started) * 1000
        killed = "timeout" if timed_out else "memory" if oom else killed
        program = ProcessOutcome.of(program_status, roles["report"].data, killed, duration, frames)
        program.stdout = roles["out"].data.decode("utf-8", "replace")
        program.stderr = roles["err"].data.decode("utf-8", "replace")
        program.truncated = output > output_cap
        program.cell_timeout = cell_timeout
        judge = None
        if judged:
            judge = ProcessOutcome.of(judge_status, roles["judge"].data, killed, duration, frames)
            judge.stderr = roles["judge_err"].data.decode("utf-8", "replace")
        return program, judge

    def _done(self) -> tuple[int, int, bool, bool]:
        """The zygote's DONE: (program status, judge status, timed out, out of memory); keeps the
        next processes' pipes."""
        try:
            message, fds, _, _ = socket.recv_fds(self.sock, 64, PROGRAM_FDS + JUDGE_FDS)
        except OSError as exc:
            raise ZygoteLost(f"cannot reach the zygote: {exc!r}") from None
        if not message:
            raise ZygoteLost("the zygote exited")
        kind, program_status, judge_status, timed_out, oom = DONE_MSG.unpack(message)
        if kind != DONE or len(fds) not in (PROGRAM_FDS, PROGRAM_FDS + JUDGE_FDS):
            for fd in fds:
                os.close(fd)
            raise ZygoteLost(f"unexpected message from the zygote: {message!r}")
        self.program = fds[:PROGRAM_FDS]
        if len(fds) > PROGRAM_FDS:
            self.judge = fds[PROGRAM_FDS:]
        self.awaiting_done = False
        return program_status, judge_status, timed_out, oom

    # -- runs -----------------------------------------------------------------------------------
    def _execute_one(self, spec: ProgramSpec, wall_s: float, caps: tuple[int, int]) -> ProcessOutcome:
        return self.execute(spec, None, wall_s, caps)[0]

    def run(self, request: PreparedRun) -> RunResultData:
        if request.get("language", "python") != "python":
            return compiled_runs.run_program(self._execute_one, self.artifacts, request)
        limits, tests, source = request["limits"], request["tests"], request["code"]
        caps = (limits["output_bytes"], limits["report_bytes"])
        wall = limits["wall_time_s"] + 0.05
        if tests["kind"] == "run":
            return self._run_only(source, tests, limits, caps)
        # Compiled here, so a program that does not compile costs no process at all.
        code, syntax = compile_candidate(source)
        if tests["kind"] == "stdio":
            return self._run_stdio(source, tests, limits, code, syntax)
        plan, compiled = self.plans.get(tests)
        if syntax is not None:
            return verdict.syntax_error(syntax, plan.tests)
        assert code is not None  # `compile_candidate` gives the code or why there is none
        if not isinstance(compiled, bytes):  # a call plan: the program's process gets the calls
            spec: ProgramSpec = {"kind": "calls", "source": source, "program": code, "limits": limits}
            spec["calls"] = compiled
            program, _ = self.execute(spec, None, wall, caps, len(plan.tests))
            return verdict.judge_calls(plan, program)
        spec = {"kind": "judged", "source": source, "program": code, "limits": limits}
        program, judge = self.execute(spec, ({"limits": limits}, compiled), wall, caps, len(plan.tests))
        assert judge is not None
        return verdict.judge_judged(plan, program, judge)

    def _run_stdio(
        self,
        source: str,
        tests: StdioTests,
        limits: RunLimits,
        code: CodeType | None,
        syntax: SyntaxFrame | None,
    ) -> RunResultData:
        cases = tests["cases"]
        if syntax is not None:
            return verdict.syntax_error(syntax, [c["input"][:200] for c in cases])
        assert code is not None

        def run_case(stdin: str, wall_s: float) -> ProcessOutcome:
            spec: ProgramSpec = {
                "kind": "stdio",
                "source": source,
                "program": code,
                "limits": limits,
                "stdin": stdin,
            }
            return self._execute_one(spec, wall_s, (limits["output_bytes"], limits["report_bytes"]))

        return output.run_cases(cases, limits, run_case)

    def _run_only(
        self, source: str, options: RunOnly, limits: RunLimits, caps: tuple[int, int]
    ) -> RunResultData:
        """A program without tests (`"kind": "run"`): run it, report what it did."""
        code, syntax = compile_candidate(source)
        if syntax is not None:
            return verdict.syntax_error(syntax, [])
        assert code is not None
        spec: ProgramSpec = {"kind": "run", "source": source, "program": code, "limits": limits}
        spec["stdin"] = options.get("stdin", "")
        spec["files"] = {p: base64.b64decode(c) for p, c in options.get("files", {}).items()}
        spec["fetch"] = options.get("fetch_files", [])
        if options.get("value") == "last_expression":
            spec["program"], spec["last"] = split_last_expression(source, code)
        call = options.get("call")
        if call:
            spec["call"] = (call["function"], tuple(call.get("args", [])), dict(call.get("kwargs", {})))
        cells = options.get("cells") or []
        clock = None
        if cells:
            spec["cells"] = compile_cells(cells)
            if limits["test_time_s"] < limits["wall_time_s"]:  # else the wall time comes first
                clock = CellClock(len(cells), limits["test_time_s"])
        program, _ = self.execute(spec, None, limits["wall_time_s"] + 0.05, caps, len(cells), clock)
        result = output.judge_run(program)
        result["exit_code"] = compiled_runs.exit_code(program)
        result["files"] = compiled_runs.files_of(program)
        if cells:
            result["cells"] = output.judge_cells(program, len(cells))
        if program.cell_timeout is not None:
            result["message"] = (
                f"cell {program.cell_timeout} did not end within its time limit; the session was ended"
            )
        return result

    def serve(self) -> None:
        ready: SlotInfo = {"ready": True, **self.info}
        write_frame(1, ready)
        while True:
            request = read_frame(0)
            if request is None:
                break
            result: RunResultData
            try:
                result = self.run(cast(PreparedRun, request))
            except ZygoteLost:
                raise  # the server sees this worker end, answers `sandbox_error` and restarts it
            except Exception as exc:  # a bug of ours: report it as an infrastructure fault
                result = {
                    "status": "sandbox_error",
                    "passed": 0,
                    "total": 0,
                    "message": f"worker error: {exc!r}",
                }
            write_frame(1, verdict.clean_text(result))

    def close(self) -> None:
        self.sock.close()  # the zygote ends its run (if any) and exits on end of stream
        try:
            self.zygote.wait(2)
        except subprocess.TimeoutExpired:
            self.zygote.kill()
            self.zygote.wait()
        if self.oom is not None:
            os.close(self.oom.fd)
        # What the zygote could not remove from inside its own root.
        cgroups.remove(self.info.get("cgroups", []))
        slot_dir = self.info.get("slot_dir")
        if slot_dir:
            shutil.rmtree(slot_dir, ignore_errors=True)


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
