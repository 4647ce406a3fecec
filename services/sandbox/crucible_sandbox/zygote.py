"""The zygote: a small pre-forked process that forks one isolated child per run.

Each worker slot (see `worker`) starts one zygote. The zygote imports the harness and the stdlib
modules programs commonly use, sets up its isolation (see `isolation`), freezes its heap, and
from then on only forks. It keeps the next run's process forked ahead: that process confines
itself and waits for its spec on a pipe, and the worker holds the other ends of its pipes (spec
in; report, stdout and stderr out), passed over a Unix socket. When the worker has written a
spec and says RUN, the zygote waits for the process (killing it at the wall-clock deadline, or
when the worker asks because the output cap was hit), kills whatever the run left behind,
empties the scratch directories, forks the next process and answers with the wait status.

Why a process of its own: a fork copies the parent's page tables, and every page either side
writes afterwards costs a copy-on-write fault. Those faults, not the Python work, dominated the
cost of a run while one process both forked and judged. The zygote is small and touches almost
nothing between forks; the worker, which parses requests, plans tests and judges results,
never forks.

Protocol on the socket (SOCK_SEQPACKET, one message per datagram):

* zygote -> worker, once: the isolation it set up, as JSON; then a first `DONE` (see below);
* worker -> zygote: `RUN` + wall seconds (the worker has written the spec), or `KILL`;
* zygote -> worker: `DONE` + wait status + whether the wall-clock backstop fired, with the
  worker's ends of the next run's pipes attached: that process is already forked and set up.

Usage (by the worker): python -m crucible_sandbox.zygote '<IsolationConfig as JSON>' <socket fd>
"""

from __future__ import annotations

# Modules model-written programs commonly import, loaded once here so each run starts warm.
# (Nothing here may import `threading` or `random`: their at-fork hooks would run in every child.)
import bisect  # noqa: F401
import collections  # noqa: F401
import functools  # noqa: F401
import gc
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import re  # noqa: F401
import select
import signal
import socket
import string  # noqa: F401
import struct
import sys
import time
import typing  # noqa: F401

from crucible_sandbox import harness, isolation

# The planner is needed inside a run only for a rare suite (expected values that need the program,
# in tests of several statements), but it must be imported here: a run's mount namespace hides
# /tmp and its uid may not read the install, so an import inside the run can fail.
from crucible_sandbox import plan  # noqa: F401  isort: skip

RUN, KILL, DONE = b"R", b"K", b"D"
RUN_MSG = struct.Struct(">cd")  # RUN, wall-clock seconds
DONE_MSG = struct.Struct(">ci?")  # DONE, wait status, killed by the wall-clock backstop
EXIT_SETUP_FAILED = 70


class Zygote:
    def __init__(self, iso: isolation.Isolation, sock: socket.socket) -> None:
        self.iso, self.sock = iso, sock
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)

    def _prepare(self) -> tuple[int, list[int]]:
        """Fork the next run's process ahead of its run: (pid, the worker's ends of its pipes).

        It confines itself and then waits for its spec, so a run's fork and set-up are off the
        critical path of a single run's latency.
        """
        spec_r, spec_w = os.pipe()
        report_r, report_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()  # an OSError here ends the zygote: the server restarts the slot
        if pid == 0:
            self._child([spec_r, report_w, out_w, err_w])
        for fd in (spec_r, report_w, out_w, err_w):
            os.close(fd)
        return pid, [spec_w, report_r, out_r, err_r]

    def _offer(self, status: int, timed_out: bool) -> int:
        """Answer DONE, handing over the pipes of a freshly prepared process; returns its pid."""
        pid, theirs = self._prepare()
        try:
            socket.send_fds(self.sock, [DONE_MSG.pack(DONE, status, timed_out)], theirs)
        except OSError:  # the worker is gone
            self._end(pid)
            raise SystemExit(0) from None
        finally:
            for fd in theirs:
                os.close(fd)
        return pid

    def _child(self, fds: list[int]) -> None:
        """The run's process: wire up its fds, confine it, hand over to the harness. Never returns."""
        _exit = os._exit  # bound before the candidate's code could replace it
        try:
            spec_r, report_w, out_w, err_w = fds
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            lo = 3  # close everything else: the worker socket above all
            for fd in sorted({spec_r, report_w}):
                os.closerange(lo, fd)
                lo = fd + 1
            os.closerange(lo, 1 << 16)
            self.iso.enter_run()
            harness.child_main(spec_r, report_w, self.iso.become_run_user)
        except BaseException as exc:  # isolation failed: say so on stderr, never run the code
            try:
                os.write(2, f"sandbox: run set-up failed: {exc!r}\n".encode())
            finally:
                _exit(EXIT_SETUP_FAILED)
        _exit(0)

    def _wait(self, pid: int, wall_s: float) -> tuple[int, bool]:
        """Wait for the run's process; kill it at the deadline or on the worker's KILL."""
        pidfd = os.pidfd_open(pid)
        self.poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + wall_s
        timed_out = False
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                events = self.poller.poll(remaining * 1000)
                if any(fd == pidfd for fd, _ in events):
                    break  # it exited
                if events:
                    message = self._receive()
                    if message == KILL:
                        break
                    if not message:  # the worker is gone: end the run and then ourselves
                        self._end(pid)
                        raise SystemExit(0)
            self._kill(pid)
            _, status = os.waitpid(pid, 0)
        finally:
            self.poller.unregister(pidfd)
            os.close(pidfd)
        return status, timed_out

    def _receive(self) -> bytes:
        try:
            return self.sock.recv(64)
        except ConnectionResetError:  # the worker closed with our last DONE unread
            return b""

    def _end(self, pid: int) -> None:
        """Kill and reap a process that will not run (the worker is gone)."""
        self._kill(pid)
        os.waitpid(pid, 0)
        self.iso.end_run(pid)

    @staticmethod
    def _kill(pid: int) -> None:
        for kill in (os.killpg, os.kill):  # its group (it called setsid), then itself in any case
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def serve(self) -> None:
        pid = self._offer(0, False)  # the first prepared process
        while True:
            message = self._receive()
            if not message:
                break
            if message[:1] != RUN:
                continue  # a KILL that arrived after its run had already ended
            _, wall_s = RUN_MSG.unpack(message)
            status, timed_out = self._wait(pid, wall_s)
            self.iso.end_run(pid)
            pid = self._offer(status, timed_out)
        self._end(pid)


def main() -> None:
    cfg = isolation.IsolationConfig(**json.loads(sys.argv[1]))
    sock = socket.socket(fileno=int(sys.argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server owns shutdown: its workers close our socket
    iso = isolation.setup_zygote(cfg)
    sock.send(json.dumps({"caps": vars(iso.caps), "mode": iso.caps.mode, "pid": os.getpid()}).encode())
    zygote = Zygote(iso, sock)
    # Everything loaded so far lives as long as the zygote: keep it out of the collector, so a
    # run's `gc.collect()` is cheap and forked pages stay shared.
    gc.collect()
    gc.freeze()
    try:
        zygote.serve()
    finally:
        iso.close()


if __name__ == "__main__":
    main()
