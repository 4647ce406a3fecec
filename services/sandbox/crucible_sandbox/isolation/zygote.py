"""The zygote: a small pre-forked process that forks the isolated processes of every run.

Each worker slot (see `judging.worker`) starts one zygote. The zygote imports the in-run code and the
stdlib modules programs commonly use, sets up its isolation (see `confine`), freezes its heap,
and from then on only forks. It keeps a run's processes forked ahead: a *program* process and a
*judge* process (see `inrun.harness`, `inrun.judge`), each confined and waiting for its spec on a socket; the
worker holds the other ends of their pipes, passed over a Unix socket. When the worker has written
the specs and says RUN, the zygote waits for the run's processes (killing them at the wall-clock
deadline, when the worker asks because a cap was hit, or when the sampled memory of the run, or
what it wrote to a run directory that is not a tmpfs of its own, is over its limit), kills
whatever the run left behind, empties the scratch directories, forks replacements for the
processes the run used and answers with their wait statuses.

Why a process of its own: a fork copies the parent's page tables, and every page either side
writes afterwards costs a copy-on-write fault. Those faults, not the Python work, dominated the
cost of a run while one process both forked and judged. The zygote is small and touches almost
nothing between forks; the worker, which parses requests, plans tests and judges results,
never forks.

Protocol on the socket (SOCK_SEQPACKET, one message per datagram):

* zygote -> worker, once: the isolation it set up, as JSON; then a first `DONE` (see below);
* worker -> zygote: `RUN` + wall seconds + whether the judge takes part + the memory limit
  (the worker has written the specs), or `KILL`;
* zygote -> worker: `DONE` + the program's and the judge's wait statuses + whether the wall-clock
  backstop fired + whether the sampled memory limit ended the run (the kernel's OOM kills under a
  cgroup's limit the worker counts itself, see `cgroups.OomCounter`), with the worker's ends of the pipes
  of the processes forked for the next run attached (the program's four, then the judge's three
  when a new judge was forked).

Usage (by the worker): python -m crucible_sandbox.isolation.zygote '<SlotConfig as JSON>' <socket fd>
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
import typing

# Everything a run's processes execute of the sandbox is imported here: a run's file system has
# none of the sandbox's files (see `rootfs`).
from crucible_sandbox.inrun import harness, judge
from crucible_sandbox.isolation import confine

if typing.TYPE_CHECKING:
    from crucible_sandbox.wire.messages import SlotConfig, ZygoteInfo

RUN, KILL, DONE = b"R", b"K", b"D"
RUN_MSG = struct.Struct(">cd?i")  # RUN, wall-clock seconds, the judge takes part, memory MiB
DONE_MSG = struct.Struct(">cii??")  # DONE, program status, judge status, timed out, memory
PROGRAM_FDS, JUDGE_FDS = 4, 3
EXIT_SETUP_FAILED = 70


class Prepared:
    """A process forked ahead of its run, and the worker's ends of its pipes."""

    def __init__(self, pid: int, theirs: list[int]) -> None:
        self.pid, self.theirs = pid, theirs


class Zygote:
    def __init__(self, iso: confine.Isolation, sock: socket.socket) -> None:
        self.iso, self.sock = iso, sock
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)

    def _prepare(self, judging: bool) -> Prepared:
        """Fork a run's program (or judge) process ahead of its run.

        It confines itself and then waits for its spec, so fork and set-up are off the critical
        path of a single run's latency.
        """
        spec_ours, spec_theirs = (s.detach() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
        report_r, report_w = os.pipe()
        err_r, err_w = os.pipe()
        out_r, out_w = os.pipe() if not judging else (-1, -1)
        pid = os.fork()  # an OSError here ends the zygote: the server restarts the slot
        if pid == 0:
            os.close(spec_ours)
            self._child(judging, spec_theirs, report_w, out_w, err_w)
        for fd in (spec_theirs, report_w, out_w, err_w):
            if fd >= 0:
                os.close(fd)
        theirs = [spec_ours, report_r, err_r] if judging else [spec_ours, report_r, out_r, err_r]
        return Prepared(pid, theirs)

    def _child(self, judging: bool, spec: int, report: int, out: int, err: int) -> None:
        """A run's process: wire up its fds, confine it, hand over. Never returns."""
        _exit = os._exit  # bound before the candidate's code could replace it
        try:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null if judging else out, 1)
            os.dup2(err, 2)
            if judging:
                self.iso.enter_judge()
                keep = {spec, report}
            else:
                self.iso.enter_program()
                keep = {spec, report, *self.iso.keep_fds()}
            lo = 3  # close everything else: the worker socket above all
            for fd in sorted(keep):
                os.closerange(lo, fd)
                lo = fd + 1
            os.closerange(lo, 1 << 16)
            if judging:
                judge.judge_main(spec, report, self.iso.confine_judge)
            else:
                harness.program_main(spec, report, self.iso.confine_program)
        except BaseException as exc:  # isolation failed: say so on stderr, never run the code
            try:
                os.write(2, f"sandbox: run set-up failed: {exc!r}\n".encode())
            finally:
                _exit(EXIT_SETUP_FAILED)
        _exit(0)

    def _offer(self, status: tuple[int, int, bool, bool], program: Prepared, judge_: Prepared | None) -> None:
        """Answer DONE, handing over the pipes of the processes forked for the next run."""
        fds = program.theirs + (judge_.theirs if judge_ else [])
        try:
            socket.send_fds(self.sock, [DONE_MSG.pack(DONE, *status)], fds)
        except OSError:  # the worker is gone
            self._end([program.pid] + ([judge_.pid] if judge_ else []))
            raise SystemExit(0) from None
        finally:
            for fd in fds:
                os.close(fd)

    def _wait(
        self, pids: list[int], wall_s: float, memory_mb: int, spare: int | None
    ) -> tuple[list[int], bool, bool]:
        """Wait for the run's processes; kill them at the deadline, on KILL or past the memory limit.

        `pids[0]` leads (the judge when there is one, else the program; the program is last): once
        it has exited, the others get a moment to finish writing, then they are killed.
        Returns (wait statuses in the order of `pids`, timed out, over the sampled memory limit).
        """
        pidfds = {os.pidfd_open(pid): pid for pid in pids}
        for fd in pidfds:
            self.poller.register(fd, select.POLLIN)
        statuses = dict.fromkeys(pids, 0)
        running = set(pids)
        deadline = time.monotonic() + wall_s
        program, others = pids[-1], {*pids[:-1], spare}
        sampled = self.iso.caps.memory == "sampled" and memory_mb > 0
        scratch = self.iso.sampled_scratch
        timed_out = over_memory = stop = gone = False
        try:
            while running and not stop:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = pids[0] in running
                    break
                # A run's scratch outside a tmpfs is bounded only by these samples: sampled more
                # often, so that a fast writer passes the limit by fewer files before it is seen.
                every = confine.SCRATCH_SAMPLE_S if scratch else confine.SAMPLE_S
                events = self.poller.poll(min(remaining, every if sampled or scratch else remaining) * 1000)
                for fd, _ in events:
                    pid = pidfds.get(fd)
                    if pid is None:
                        message = self._receive()
                        if message == KILL:
                            stop = True
                        elif not message:  # the worker is gone: end the run and then ourselves
                            stop = gone = True
                    elif pid in running:
                        running.discard(pid)
                        self.poller.unregister(fd)
                        _, statuses[pid] = os.waitpid(pid, 0)
                        if pid == pids[0]:
                            deadline = min(deadline, time.monotonic() + 0.5)
                if sampled and program in running and self.iso.memory_used(program, others) > memory_mb << 20:
                    over_memory = True
                    break
                # A run's directory on a shared disk past the full mode's scratch size: ended like a
                # run over its memory (that scratch is a tmpfs, which is memory). Checked at every
                # wake, the one for the program's exit too: a writer that finished between two
                # samples is still judged over the limit.
                if scratch and self.iso.scratch_over(program, others):
                    over_memory = True
                    break
        finally:
            for fd, pid in pidfds.items():
                if pid in running:
                    self.poller.unregister(fd)
                    self._kill(pid)
                    _, statuses[pid] = os.waitpid(pid, 0)
                os.close(fd)
        if gone:
            self.iso.end_run(pids, program, spare)
            raise SystemExit(0)
        return [statuses[pid] for pid in pids], timed_out, over_memory

    def _receive(self) -> bytes:
        try:
            return self.sock.recv(64)
        except ConnectionResetError:  # the worker closed with our last DONE unread
            return b""

    def _end(self, pids: list[int]) -> None:
        """Kill and reap processes that will not run (the worker is gone)."""
        for pid in pids:
            self._kill(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.iso.end_run(pids, pids[0], None)

    @staticmethod
    def _kill(pid: int) -> None:
        for kill in (os.killpg, os.kill):  # its group (it called setsid), then itself in any case
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def serve(self) -> None:
        program, judge_ = self._prepare(False), self._prepare(True)
        self._offer((0, 0, False, False), program, judge_)
        while True:
            message = self._receive()
            if not message:
                break
            if message[:1] != RUN:
                continue  # a KILL that arrived after its run had already ended
            _, wall_s, judged, memory_mb = RUN_MSG.unpack(message)
            pids = [judge_.pid, program.pid] if judged else [program.pid]
            written = self.iso.written()
            statuses, timed_out, over_memory = self._wait(
                pids, wall_s, memory_mb, None if judged else judge_.pid
            )
            self.iso.end_run(pids, program.pid, None if judged else judge_.pid)  # reaps what is left
            over_memory = over_memory or self.iso.wrote_past_scratch(written)
            program_status = statuses[-1]
            judge_status = statuses[0] if judged else 0
            program = self._prepare(False)
            fresh = self._prepare(True) if judged else None
            if fresh is not None:
                judge_ = fresh
            self._offer((program_status, judge_status, timed_out, over_memory), program, fresh)
        self._end([program.pid, judge_.pid])


def main() -> None:
    config: SlotConfig = json.loads(sys.argv[1])
    cfg = confine.IsolationConfig(**config)
    sock = socket.socket(fileno=int(sys.argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server owns shutdown: its workers close our socket
    iso = confine.setup_zygote(cfg)
    info: ZygoteInfo = {
        "caps": iso.caps.report(),
        "mode": iso.caps.mode,
        "pid": os.getpid(),
        "cgroups": iso.cgroup.paths if iso.cgroup else [],
        "oom_file": iso.cgroup.oom_file if iso.cgroup and iso.caps.memory != "sampled" else None,
        "slot_dir": iso.slot_dir,
    }
    sock.send(json.dumps(info).encode())
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
