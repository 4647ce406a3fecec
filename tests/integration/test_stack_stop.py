"""`crucible up` stopping and starting again: the stop order, a stopping worker handing its job
back, ports in TIME_WAIT, and the W&B mode a spec chose."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from crucible_cli.spawn import free_port, port_free
from crucible_shared import keys
from crucible_shared.lifecycle import JobRecord, JobStatus
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from tests.integration.endless_job import queue_record
from tests.servers import RedisServer

# A stand-in for the gateway, generator or sandbox: on SIGTERM it notes when, and whether Redis
# still answered then, and exits.
SERVICE = """
import json, signal, sys, time
from redis import Redis
name, marks, url = sys.argv[1:4]
def stop(*_):
    try:
        up = bool(Redis.from_url(url, socket_connect_timeout=1).ping())
    except Exception:
        up = False
    with open(marks, "a") as f:
        f.write(json.dumps({"name": name, "term": time.time(), "redis_up": up}) + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(0.1)
"""


@pytest.mark.slow
def test_stopping_the_stack_stops_workers_first_and_they_hand_their_job_back(tmp_path: Path) -> None:
    """A worker in the middle of a long step: `Stack.stop` stops it first (a second SIGTERM after
    `worker_stop_s`), its job is re-queued, not left `running`; the other services are stopped
    after it, and Redis last."""
    from crucible_cli.stack import Stack

    redis = RedisServer(tmp_path / "redis")
    stack = Stack(state_dir=tmp_path / "state", worker_stop_s=3)
    marks = tmp_path / "marks.jsonl"
    job_id = f"eval-stop-{time.time_ns()}"
    try:
        proc = stack._start("redis", redis.args(), redis.url, {})
        redis.wait(lambda: proc.popen.poll() is None)
        for name in ("gateway", "generator", "sandbox"):
            stack._start(name, [sys.executable, "-c", SERVICE, name, str(marks), redis.url], "", {})
        conn = Redis.from_url(redis.url)
        queue_record(conn, job_id)
        Queue("stop-test", connection=conn, serializer=JSONSerializer).enqueue(
            "tests.integration.endless_job.run", job_id, job_id=job_id, job_timeout=600
        )
        env = {"REDIS_URL": redis.url, "CRUCIBLE_TRAINER_HEARTBEAT_S": "0.5", "WANDB_MODE": "disabled"}
        stack._start(
            "worker", [sys.executable, "-m", "crucible_trainer.worker", "--queues", "stop-test"], "", env
        )
        deadline = time.monotonic() + 90
        while conn.hget(keys.job(job_id), "status") != b"running":
            assert time.monotonic() < deadline, f"the worker never started the job; see {tmp_path / 'state'}"
            time.sleep(0.2)
        time.sleep(1)
    finally:
        stack.stop()
    with redis:  # the same data, read back after the stop
        conn = Redis.from_url(redis.url)
        record = JobRecord.from_redis(job_id, conn.hgetall(keys.job(job_id)))
        events = [json.loads(f[b"data"]) for _, f in conn.xrange(keys.events(job_id))]
    assert record.status == JobStatus.queued and record.attempts == 1, (record.status, record.error)
    assert "stopped" in (record.error or "")
    handed_back = next(e["time"] for e in events if e["type"] == "requeued")
    stops = [json.loads(line) for line in marks.read_text().splitlines()]
    assert {s["name"] for s in stops} == {"gateway", "generator", "sandbox"}
    assert all(s["term"] > handed_back and s["redis_up"] for s in stops), (handed_back, stops)


def test_a_port_whose_connections_wait_in_time_wait_is_free() -> None:
    """A server that stopped a second ago leaves its closed connections in TIME_WAIT: a listener
    (which sets SO_REUSEADDR, as uvicorn and Redis do) can bind the port, so the stack may too."""
    port = free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server closes first: its end of the connection waits in TIME_WAIT
    time.sleep(0.1)
    client.close()
    listener.close()
    assert port_free(port)
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        assert not port_free(port)  # a listener still there does count


def test_the_stack_leaves_the_w_and_b_mode_to_the_spec(tmp_path: Path, monkeypatch) -> None:
    """`crucible up` exports no WANDB_MODE, and a spec's explicit `logging.wandb_mode` wins over
    the worker's environment; an unset one follows it."""
    from crucible_cli.stack import Stack
    from crucible_trainer.runtime.sink import start_wandb

    assert "WANDB_MODE" not in Stack(state_dir=tmp_path).service_env("redis://127.0.0.1:1/0")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert start_wandb("wandb-test", "disabled", "crucible", None, tmp_path, {}) is None
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert start_wandb("wandb-test", None, "crucible", None, tmp_path, {}) is None


# `crucible up` in miniature: a stack of stand-ins (a worker that ignores SIGTERM, services that
# take a moment to exit), stopped in `finally` after Ctrl-C, as `stack_cmd.up` does.
STACK = """
import json, signal, sys, time
from pathlib import Path
from crucible_cli.stack import Stack
# Started as a shell starts `crucible up`: Ctrl-C raising KeyboardInterrupt, no signal blocked. The
# test process may pass on other settings (both are inherited across exec: a library it loaded
# may have ignored SIGINT or blocked signals), under which no Ctrl-C would ever arrive. Say so.
blocked = sorted(signal.pthread_sigmask(signal.SIG_SETMASK, []))  # unblocks all; returns what was
handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # returns what was
if (handler, blocked) != (signal.default_int_handler, []):
    print("the test process passed on SIGINT handler and blocked signals:", (handler, blocked), file=sys.stderr)
state, out, marks = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
stubborn = (  # ignores SIGTERM, noting each one in `marks` (and R once it does)
    "import signal, sys, time\\n"
    "signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], 'a').write('T'))\\n"
    "open(sys.argv[1], 'a').write('R')\\n"
    "while True: time.sleep(0.1)"
)
slow = "import signal, sys, time\\nsignal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), sys.exit(0)))\\nwhile True: time.sleep(0.1)"
stack = Stack(state_dir=state, worker_stop_s=30)
try:
    stack._start("worker", [sys.executable, "-c", stubborn, marks], "", {})
    for name in ("gateway", "generator", "sandbox", "redis"):
        stack._start(name, [sys.executable, "-c", slow], "", {})
    Path(out).write_text(json.dumps([p.popen.pid for p in stack.procs]))
    while True:
        time.sleep(0.1)
except KeyboardInterrupt:
    pass
finally:
    stack.stop()
"""


def ctrl_c_three_times(proc: Any, pids_file: Path, marks: Path) -> list[int]:
    """Once the stack is up, three Ctrl-Cs, each after the stop answered the one before; the stop
    must end within 40 s (the worker's 30 s grace cut short). Returns the stack's PIDs."""
    import signal

    deadline = time.monotonic() + 60
    while not pids_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    while "R" not in (marks.read_text() if marks.exists() else ""):  # the worker's handler is set
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # the other stand-ins' too (one that has not just exits at its SIGTERM)
    pids = json.loads(pids_file.read_text())
    started = time.monotonic()
    # Each Ctrl-C once the stop has answered the one before (the worker's next SIGTERM): signals
    # sent at fixed times can coalesce into one on a loaded machine, and would test nothing.
    for count in (1, 2, 3):
        proc.send_signal(signal.SIGINT)
        while count < 3 and (marks.read_text() if marks.exists() else "").count("T") < count:
            assert proc.poll() is None and time.monotonic() - started < 30, "the stop did not go on"
            time.sleep(0.05)
    proc.wait(60)
    assert time.monotonic() - started < 40  # the worker's 30 s grace was cut short
    return pids


def test_a_third_ctrl_c_still_stops_every_process(tmp_path: Path) -> None:
    """Three Ctrl-Cs: each later one only shortens a grace period (the worker's first, then its
    second SIGTERM's); the stop still ends every process of the stack (none is left running,
    holding its port)."""
    import os
    import signal
    import subprocess

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        status = Path(f"/proc/{pid}/status")
        return status.exists() and "zombie" not in status.read_text()

    pids_file, marks = tmp_path / "pids.json", tmp_path / "worker-sigterms"
    proc = subprocess.Popen(
        [sys.executable, "-c", STACK, str(tmp_path / "state"), str(pids_file), str(marks)]
    )
    try:
        left = [pid for pid in ctrl_c_three_times(proc, pids_file, marks) if alive(pid)]
    finally:  # whatever is still running goes with the test, failed or not (stand-ins never exit)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in json.loads(pids_file.read_text()) if pids_file.exists() else []:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def test_a_ctrl_c_right_after_the_sigterm_still_shortens_the_grace(monkeypatch) -> None:
    """A Ctrl-C that lands between the stop's SIGTERM and its wait (the moment a process answers
    the SIGTERM, seen on a loaded machine) cuts that grace period short like any other: the wait
    must not start counting from after it."""
    import os
    import signal
    import subprocess

    from crucible_cli import stack as stack_mod

    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(600)"
    popen = subprocess.Popen(
        [sys.executable, "-c", stubborn], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert popen.stdout is not None and popen.stdout.readline().strip() == "ready"
    hurry = stack_mod.Hurry()
    real_killpg = os.killpg

    def killpg_then_ctrl_c(pgid: int, sig: int) -> None:
        real_killpg(pgid, sig)
        if sig == signal.SIGTERM:
            hurry.count += 1  # the Ctrl-C, counted by the stop's handler, before the wait begins

    monkeypatch.setattr(stack_mod.os, "killpg", killpg_then_ctrl_c)
    started = time.monotonic()
    try:
        worker = stack_mod.Proc("worker", popen, "", Path("worker.log"), [], {})
        stack_mod.Stack._stop_group([worker], 120, again_s=120, hurry=hurry)
    finally:
        if popen.poll() is None:
            real_killpg(popen.pid, signal.SIGKILL)
    assert popen.poll() is not None  # ended by the SIGKILL after both cut-short waits
    assert time.monotonic() - started < 60  # neither 120 s grace period was waited out
