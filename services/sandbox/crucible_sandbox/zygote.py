"""The zygote: a small process that forks one isolated child per run.

The server starts one zygote per worker slot with a minimal environment. A zygote imports the
harness and common stdlib modules once, sets up its isolation (see `isolation`), and then
serves runs one at a time over length-prefixed JSON frames on stdin/stdout. It keeps one
blank child forked ahead of time, so a run's fork and namespace set-up are off the critical
path. Forking from this small process (never from the HTTP server) keeps fork cheap.

Usage (by the server): python -m crucible_sandbox.zygote '<IsolationConfig as JSON>'
"""

from __future__ import annotations

# Modules model-written programs commonly import, loaded once here so each run starts warm.
import bisect  # noqa: F401
import collections  # noqa: F401
import contextlib
import dataclasses
import functools  # noqa: F401
import gc
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import re  # noqa: F401
import selectors
import signal
import string  # noqa: F401
import sys
import time
import typing  # noqa: F401

from crucible_sandbox import harness, isolation, verdict
from crucible_sandbox.channel import read_frame, split_frames, write_frame
from crucible_sandbox.plan import plan_asserts, plan_check

_READ = 1 << 16


@dataclasses.dataclass
class Child:
    pid: int
    spec_w: int
    report_r: int
    out_r: int
    err_r: int
    workdir: str | None = None


class Zygote:
    def __init__(self, cfg: isolation.IsolationConfig) -> None:
        self.cfg = cfg
        self.caps = isolation.setup_zygote(cfg)
        self.spare: Child | None = None

    # -- children ---------------------------------------------------------------------------
    def spawn(self) -> Child:
        spec_r, spec_w = os.pipe()
        report_r, report_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the run's process
            try:
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                keep = sorted({spec_r, report_w})
                lo = 3
                for fd in keep:
                    os.closerange(lo, fd)
                    lo = fd + 1
                os.closerange(lo, 1 << 16)
                isolation.enter_run(self.cfg, self.caps)
                harness.child_main(spec_r, report_w)
            except BaseException as exc:  # isolation failed: say so on stderr, never run the code
                try:
                    os.write(2, f"sandbox: run set-up failed: {exc!r}\n".encode())
                finally:
                    os._exit(70)
            os._exit(0)
        for fd in (spec_r, report_w, out_w, err_w):
            os.close(fd)
        workdir = None if self.caps.mount_namespace else os.path.join(self.cfg.work_root, f"run-{pid}")
        return Child(pid, spec_w, report_r, out_r, err_r, workdir)

    def take_child(self) -> Child:
        child, self.spare = self.spare, None
        return child or self.spawn()

    def collect(self, child: Child, spec: dict, wall_s: float, output_cap: int) -> verdict.ProcessOutcome:
        """Send the spec, then read the child's report, stdout and stderr until it ends."""
        started = time.perf_counter()
        deadline = time.monotonic() + wall_s
        proc = verdict.ProcessOutcome()
        try:
            write_frame(child.spec_w, spec)
        except OSError:
            pass  # the child died before reading: seen below as a harness that did not start
        os.close(child.spec_w)
        buffers = {child.report_r: bytearray(), child.out_r: bytearray(), child.err_r: bytearray()}
        sel = selectors.DefaultSelector()
        for fd in buffers:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        pidfd = os.pidfd_open(child.pid)
        sel.register(pidfd, selectors.EVENT_READ)
        output = 0
        status: int | None = None
        exited_at: float | None = None
        open_fds = set(buffers)
        while True:
            now = time.monotonic()
            if now >= deadline:
                proc.killed = "timeout"
                break
            if exited_at is not None and (not open_fds or now - exited_at > 0.05):
                break  # a descendant may hold the pipes open; it is killed below
            for key, _ in sel.select(min(deadline - now, 0.05) if exited_at else deadline - now):
                fd = key.fd
                if fd == pidfd:
                    _, status = os.waitpid(child.pid, 0)
                    exited_at = time.monotonic()
                    sel.unregister(pidfd)
                    continue
                try:
                    data = os.read(fd, _READ)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                    continue
                if fd == child.report_r:
                    buffers[fd] += data
                    continue
                output += len(data)
                room = output_cap - (output - len(data))
                if room > 0:
                    buffers[fd] += data[:room]
                if output > output_cap:
                    proc.killed = "output"
                    proc.truncated = True
                    break
            if proc.killed:
                break
        if status is None:
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)
            _, status = os.waitpid(child.pid, 0)
        isolation.kill_everything(child.pid, self.caps)
        sel.close()
        os.close(pidfd)
        for fd in buffers:
            os.close(fd)
        if child.workdir:
            isolation.remove_workdir(child.workdir)
        elif self.caps.mount_namespace:
            isolation.empty_scratch()
        proc.duration_ms = (time.perf_counter() - started) * 1000
        if os.WIFSIGNALED(status):
            proc.signal = os.WTERMSIG(status)
        else:
            proc.exit_code = os.WEXITSTATUS(status)
        if proc.killed:
            proc.signal = None
        try:
            proc.frames = split_frames(buffers[child.report_r])
        except (ValueError, UnicodeDecodeError):
            proc.frame_error = True
        proc.stdout = buffers[child.out_r].decode("utf-8", "replace")
        proc.stderr = buffers[child.err_r].decode("utf-8", "replace")
        return proc

    # -- runs -------------------------------------------------------------------------------
    def run(self, request: dict) -> dict:
        limits = request["limits"]
        tests = request["tests"]
        if tests["kind"] == "stdio":
            return self._run_stdio(request)
        plan = plan_asserts(tests["asserts"]) if tests["kind"] == "asserts" else plan_check(tests["check"])
        proc = self.collect(self.take_child(), request, limits["wall_time_s"] + 0.05, limits["output_bytes"])
        return verdict.judge_tests(plan, proc)

    def _run_stdio(self, request: dict) -> dict:
        limits = request["limits"]
        cases = request["tests"]["cases"]
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
            spec = {**request, "stdin": case["input"], "tests": {"kind": "stdio"}}
            proc = self.collect(
                self.take_child(), spec, min(limits["test_time_s"], remaining), limits["output_bytes"]
            )
            syntax = next((f for f in proc.frames if isinstance(f, dict) and f.get("t") == "syntax"), None)
            if syntax is not None:
                result = verdict.summarise_cases([], [proc], len(cases))
                result.update(
                    status="syntax_error",
                    message=str(syntax.get("msg")),
                    traceback=syntax.get("tb"),
                    exception_type="SyntaxError",
                    tests=[
                        {"index": j, "test": c["input"][:200], "status": "not_run", "message": ""}
                        for j, c in enumerate(cases)
                    ],
                    passed=0,
                )
                return result
            verdicts.append(verdict.judge_case(i, case["input"], case["output"], proc))
            procs.append(proc)
        return verdict.summarise_cases(verdicts, procs, len(cases))

    def serve(self) -> None:
        write_frame(
            1,
            {
                "ready": True,
                "pid": os.getpid(),
                "caps": dataclasses.asdict(self.caps),
                "mode": self.caps.mode,
            },
        )
        self.spare = self.spawn()
        while True:
            request = read_frame(0)
            if request is None:
                break
            try:
                result = self.run(request)
            except Exception as exc:  # a bug of ours: report it as an infrastructure fault
                result = {
                    "status": "sandbox_error",
                    "passed": 0,
                    "total": 0,
                    "message": f"zygote error: {exc!r}",
                }
            write_frame(1, result)
            if self.spare is None:
                self.spare = self.spawn()
        if self.spare:
            os.kill(self.spare.pid, signal.SIGKILL)


def main() -> None:
    cfg = isolation.IsolationConfig(**json.loads(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server owns shutdown: it closes our stdin
    zygote = Zygote(cfg)
    # Everything loaded so far lives as long as the zygote: keep it out of the collector, so
    # a run's `gc.collect()` is cheap and forked pages stay shared.
    gc.collect()
    gc.freeze()
    zygote.serve()


if __name__ == "__main__":
    main()
