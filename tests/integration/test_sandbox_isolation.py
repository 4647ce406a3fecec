"""One adversarial test per isolation property, run concurrently with benign runs.

Each hostile program runs in the same batch as benign programs whose results must not
change; afterwards no run process survives and nothing written leaks to the host or to
the next run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import SECRET, UID_BASE

FULL = os.geteuid() == 0  # the CI and dev machines run as root: full isolation is exercised


def asserts(*items: str) -> dict:
    return {"kind": "asserts", "asserts": list(items)}


BENIGN = [
    {
        "code": f"def sq(x):\n    return x * x + {i}\n",
        "tests": asserts(f"assert sq(3) == {9 + i}", f"assert sq(0) == {i}"),
        "use_cache": False,
    }
    for i in range(6)
]

LIMITS = {"wall_time_s": 3, "test_time_s": 2}
# Every way the sandbox may stop a fork bomb: which limit it reaches first (wall time, the process
# count, the memory of the run's processes together) depends on the host and its load. What must
# hold is that it is stopped, the sandbox stays healthy and the benign run beside it passes.
CONTAINED = {"timeout", "error", "memory_exceeded", "output_exceeded"}

# name -> (program, tests, acceptable statuses)
HOSTILE: dict[str, tuple[str, dict, set[str]]] = {
    "infinite_loop": ("def f():\n    while True:\n        pass\n", asserts("assert f() == 1"), {"timeout"}),
    "sigalrm_ignored": (
        "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef f():\n    while True:\n        pass\n",
        asserts("assert f() == 1"),
        {"timeout"},
    ),
    "sleep": (
        "import time\ndef f():\n    time.sleep(30)\n    return 1\n",
        asserts("assert f() == 1"),
        {"timeout"},
    ),
    "fork_bomb": (
        "import os\ndef f():\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n",
        asserts("assert f() == 1"),
        CONTAINED,
    ),
    "setsid_daemon": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
        "def f():\n    return 1\n",
        asserts("assert f() == 1"),
        {"passed"},
    ),
    # Within this batch's 3 s of wall time a loaded machine may stop it by time first; the verdict
    # itself is test_memory_bomb_reports_memory's.
    "memory_bomb": (
        "def f():\n    x = []\n    while True:\n        x.append(' ' * 10**7)\n",
        asserts("assert f() == 1"),
        {"memory_exceeded", "timeout"},
    ),
    "deep_recursion": ("def f(n):\n    return f(n + 1) + 1\n", asserts("assert f(0) == 1"), {"error"}),
    "stdout_flood": (
        "def f():\n    while True:\n        print('x' * 1000)\n",
        asserts("assert f() == 1"),
        {"output_exceeded"},
    ),
    "stderr_flood": (
        "import sys\ndef f():\n    while True:\n        sys.stderr.write('y' * 1000)\n",
        asserts("assert f() == 1"),
        {"output_exceeded"},
    ),
    "disk_fill": (
        "import os\ndef f():\n    for i in range(10**6):\n        with open(f'fill{i}', 'w') as fh:\n            fh.write('z' * 10**6)\n    return 1\n",
        asserts("assert f() == 1"),
        {"error"},
    ),
    "network": (
        "import socket\ndef f():\n    s = socket.create_connection(('127.0.0.1', 6379), timeout=1)\n    return 1\n",
        asserts("assert f() == 1"),
        {"error"} if FULL else {"error", "passed"},
    ),
    "kill_parent": (
        "import os, signal\ndef f():\n    for pid in (os.getppid(), 1):\n        try:\n            os.kill(pid, signal.SIGKILL)\n        except OSError:\n            pass\n"
        "    os.killpg(0, signal.SIGKILL)\n",
        asserts("assert f() == 1"),
        {"error"},
    ),
}


def _run_batch(sandbox, runs: list[dict]) -> list[dict]:
    r = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _run_processes(started_before: float) -> list[int]:
    """PIDs owned by the sandbox's run uids that started before `started_before` (seconds since boot).

    Each zygote keeps one blank process forked ahead for its next run; those are newer.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
        except OSError:
            continue
        if UID_BASE <= uid < UID_BASE + 64:
            try:
                start = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
            except (OSError, IndexError, ValueError):
                continue
            if start < started_before:
                pids.append(int(entry))
    return pids


@pytest.mark.slow
def test_hostile_programs_are_contained_and_benign_runs_unaffected(sandbox) -> None:
    hostile = [
        {"code": code, "tests": tests, "limits": LIMITS, "use_cache": False}
        for code, tests, _ in HOSTILE.values()
    ]
    # Interleave so benign runs execute while hostile ones hold the other worker.
    runs, where = [], {}
    for i, h in enumerate(hostile):
        where[i] = len(runs)
        runs.append(h)
        runs.append(BENIGN[i % len(BENIGN)])
    results = _run_batch(sandbox, runs)
    for i, (name, (_, _, allowed)) in enumerate(HOSTILE.items()):
        got = results[where[i]]
        assert got["status"] in allowed, f"{name}: {got['status']} {got['message']}"
    for i, result in enumerate(results):
        if i not in where.values():
            assert result["status"] == "passed", result
    assert httpx.get(f"{sandbox.url}/health").json()["status"] == "ok"
    if FULL:
        after_batch = _uptime()
        time.sleep(0.05)
        _run_batch(sandbox, BENIGN[:4])  # every worker replaces its blank process
        assert _run_processes(after_batch) == [], "a run process outlived its run"


def test_memory_bomb_reports_memory(sandbox) -> None:
    code, tests, _ = HOSTILE["memory_bomb"]
    out = httpx.post(
        f"{sandbox.url}/v1/runs",
        json={"code": code, "tests": tests, "limits": {"memory_mb": 128}},
        timeout=60,
    ).json()
    assert out["status"] == "memory_exceeded"
    assert out["tests"][0]["exception_type"] == "MemoryError"


def test_output_is_capped(sandbox) -> None:
    code, tests, _ = HOSTILE["stdout_flood"]
    out = httpx.post(
        f"{sandbox.url}/v1/runs",
        json={"code": code, "tests": tests, "limits": {"output_bytes": 5000}},
        timeout=60,
    ).json()
    assert out["status"] == "output_exceeded" and out["output_truncated"]
    assert len(out["stdout"]) <= 5000


@pytest.mark.skipif(not FULL, reason="private /tmp needs a mount namespace (root)")
def test_files_in_tmp_are_not_visible_to_the_next_run(sandbox) -> None:
    marker = f"crucible-leak-{os.getpid()}"
    write = f"def f():\n    for d in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n        open(d + '/{marker}', 'w').write('x')\n    return 1\n"
    read = f"import os\ndef f():\n    return [d for d in ('/tmp', '/var/tmp', '/dev/shm', '.') if os.path.exists(d + '/{marker}')]\n"
    first = _run_batch(sandbox, [{"code": write, "tests": asserts("assert f() == 1"), "use_cache": False}])[0]
    assert first["status"] == "passed", first
    for _ in range(4):  # both workers, twice
        again = _run_batch(
            sandbox, [{"code": read, "tests": asserts("assert f() == []"), "use_cache": False}]
        )[0]
        assert again["status"] == "passed", again["message"]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not Path(d, marker).exists(), f"a run's file leaked to the host's {d}"


def test_server_environment_is_not_readable(sandbox) -> None:
    code = (
        "import os\n"
        "def f():\n"
        "    found = [k for k, v in os.environ.items() if 'crucible-test-secret' in v or k.startswith('CRUCIBLE')]\n"
        "    for pid in os.listdir('/proc'):\n"
        "        try:\n"
        "            if b'crucible-test-secret' in open(f'/proc/{pid}/environ', 'rb').read():\n"
        "                found.append(pid)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return found\n"
    )
    out = _run_batch(sandbox, [{"code": code, "tests": asserts("assert f() == []"), "use_cache": False}])[0]
    assert SECRET.startswith("crucible-test-secret")
    assert out["status"] == "passed", out["message"]


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)\ndef add(a, b): return 0\n",
        "exit(0)\n",
        "import os\nos._exit(0)\n",
        "def add(a, b):\n    import os\n    os._exit(0)\n",
        "def add(a, b):\n    raise SystemExit(0)\n",
        "print('PASS')\nprint('all tests passed')\ndef add(a, b): return 0\n",
        "def add(a, b):\n    class Yes:\n        def __eq__(self, other): return True\n        def __ne__(self, other): return False\n    return Yes()\n",
        "def add(a, b):\n    class Yes(int):\n        def __eq__(self, other): return True\n    return Yes(0)\n",
        "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\ndef add(a, b): return 0\n",
        "import crucible_sandbox.inrun.harness as h\nh.Checker.check = lambda *a, **k: None\nh.Checker.fail = lambda *a, **k: None\ndef add(a, b): return 0\n",
        "import operator\noperator.eq = lambda a, b: True\ndef add(a, b): return 0\n",
        'import sys\ndef add(a, b):\n    sys.stdout.write(\'{"status": "passed"}\')\n    return 0\n',
    ],
    ids=[
        "sys.exit",
        "exit",
        "os._exit",
        "os._exit-in-test",
        "SystemExit-in-test",
        "print-pass",
        "eq-always-true",
        "int-subclass-eq",
        "patch-builtins",
        "patch-harness",
        "patch-operator",
        "fake-json",
    ],
)
def test_reward_hacks_do_not_pass(sandbox, code) -> None:
    # One assert per test (run by the harness itself) and tests of several statements (run as
    # instrumented code): each form has its own path through the harness.
    single = ["assert add(2, 2) == 4", "assert add(1, 1) == 2"]
    several = ["x = add(2, 2)\nassert x == 4", "y = add(1, 1)\nassert y == 2"]
    runs = [
        {"code": code, "tests": {"kind": "asserts", "asserts": a}, "use_cache": False}
        for a in (single, several)
    ]
    for out in _run_batch(sandbox, runs):
        assert out["status"] != "passed" and out["passed"] == 0, out


def test_reward_hacks_do_not_pass_check_form(sandbox) -> None:
    check = "def check(candidate):\n    assert candidate(2, 2) == 4\n    assert candidate(1, 1) == 2\n"
    hacks = [
        "import sys\nsys.exit(0)\n",
        "def add(a, b):\n    class Yes:\n        def __eq__(self, other): return True\n    return Yes()\n",
        "def add(a, b):\n    import os\n    os._exit(0)\n",
    ]
    runs = [
        {"code": c, "tests": {"kind": "check", "check": check, "entry_point": "add"}, "use_cache": False}
        for c in hacks
    ]
    for out in _run_batch(sandbox, runs):
        assert out["status"] != "passed" and out["passed"] == 0, out


@pytest.mark.skipif(not FULL, reason="scratch is a tmpfs of its own only with full isolation")
def test_nothing_written_to_scratch_runs_as_a_program(sandbox) -> None:
    """Scratch is mounted noexec: a program cannot write a script or binary there and run it."""
    code = (
        "import os, subprocess\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
        "    p = os.path.join(d, 'x.sh')\n"
        "    with open(p, 'w') as f:\n"
        "        f.write('#!/bin/sh\\necho ran\\n')\n"
        "    os.chmod(p, 0o755)\n"
        "    try:\n"
        "        out = subprocess.run([p], capture_output=True, text=True).stdout.strip()\n"
        "    except PermissionError:\n"
        "        out = 'refused'\n"
        "    print(d, out)\n"
    )
    r = httpx.post(
        f"{sandbox.url}/v1/runs", json={"code": code, "tests": {"kind": "run"}, "use_cache": False}
    )
    result = r.json()
    assert result["status"] == "passed", result
    assert result["stdout"].splitlines() == ["/tmp refused", "/var/tmp refused", "/dev/shm refused"], result
