"""SandboxFusion's API (`/run_code`, `/run_jupyter`) on the real service, driven by the unmodified `sandbox-fusion`
client (sync and async) and by the request shapes verl's `sandbox_fusion` reward sends."""

from __future__ import annotations

import asyncio
import base64
import os
import time

import httpx
import pytest
from sandbox_fusion import (
    CommandRunStatus,
    RunCodeRequest,
    RunJupyterRequest,
    RunStatus,
    SummaryMapping,
    run_code,
    run_code_async,
    run_jupyter,
    run_jupyter_async,
    summary_run_code_result,
)

from tests.integration.conftest import UID_BASE
from tests.servers import spawn


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def post(sandbox, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{sandbox.url}/run_code", json=body, headers=headers or {}, timeout=60)


def test_client_runs_python_with_stdin_files_and_fetch(sandbox) -> None:
    code = (
        "import sys\n"
        "name = open('data/in.txt').read().strip()\n"
        "line = sys.stdin.readline().strip()\n"
        "open('out.txt', 'w').write(name.upper() + line)\n"
        "print('hello', name)\n"
    )
    request = RunCodeRequest(
        code=code,
        language="python",
        stdin="!\n",
        files={"data/in.txt": b64("world")},
        fetch_files=["out.txt", "missing.txt"],
    )
    out = run_code(request, endpoint=sandbox.url, max_attempts=1)
    assert out.status == RunStatus.Success, out
    assert out.compile_result is None
    assert out.run_result.status == CommandRunStatus.Finished
    assert (out.run_result.return_code, out.run_result.stdout) == (0, "hello world\n")
    assert out.run_result.execution_time is not None and out.run_result.execution_time < 10
    assert base64.b64decode(out.files["out.txt"]) == b"WORLD!"
    assert "missing.txt" not in out.files
    assert summary_run_code_result(out, SummaryMapping()) == RunStatus.Success


@pytest.mark.parametrize(
    ("code", "return_code", "in_stderr"),
    [
        ("import sys\nprint('x')\nsys.exit(3)\n", 3, ""),
        ("def f(:\n", 1, "SyntaxError"),
        ("print('before')\nraise ValueError('boom')\n", 1, "ValueError: boom"),
    ],
)
def test_failures_are_failed_with_the_return_code(
    sandbox, code: str, return_code: int, in_stderr: str
) -> None:
    out = run_code(RunCodeRequest(code=code, language="python"), endpoint=sandbox.url, max_attempts=1)
    assert out.status == RunStatus.Failed
    assert out.run_result.status == CommandRunStatus.Finished
    assert out.run_result.return_code == return_code
    assert in_stderr in out.run_result.stderr
    assert summary_run_code_result(out, SummaryMapping(RunFailed="rf")) == "rf"


def test_time_limit_is_time_limit_exceeded(sandbox) -> None:
    request = RunCodeRequest(code="while True:\n    pass\n", language="python", run_timeout=1)
    out = run_code(request, endpoint=sandbox.url, max_attempts=1)
    assert out.status == RunStatus.Failed
    assert out.run_result.status == CommandRunStatus.TimeLimitExceeded
    assert summary_run_code_result(out, SummaryMapping(RunTimeout="tle")) == "tle"


def test_memory_and_output_limits_read_as_killed(sandbox) -> None:
    bomb = "x = []\nwhile True:\n    x.append(' ' * 10**7)\n"
    out = run_code(RunCodeRequest(code=bomb, language="python"), endpoint=sandbox.url, max_attempts=1)
    r = httpx.post(
        f"{sandbox.url}/run_code",
        json={"code": bomb, "language": "python", "memory_limit_MB": 64},
        timeout=60,
    ).json()
    for result in (out.dict(), r):
        assert result["status"] == "Failed"
        assert result["run_result"]["status"] == "Finished" and result["run_result"]["return_code"] == -9
        assert "memory" in result["run_result"]["stderr"].lower()
    assert summary_run_code_result(out, SummaryMapping(RunFailed="rf")) == "rf"


def test_async_client_many_at_once(sandbox) -> None:
    async def main() -> list:
        requests = [RunCodeRequest(code=f"print(sum(range({n})))", language="python") for n in range(12)]
        return await asyncio.gather(
            *(run_code_async(r, endpoint=sandbox.url, max_attempts=1) for r in requests)
        )

    results = asyncio.run(main())
    assert [r.run_result.stdout for r in results] == [f"{sum(range(n))}\n" for n in range(12)]
    assert all(r.status == RunStatus.Success for r in results)


def test_verl_request_shape(sandbox) -> None:
    """The JSON verl's `call_sandbox_api` posts, one request per stdin case (its shape, not its code)."""
    code = "a, b = map(int, input().split())\nprint(a * b)\n"
    for stdin, expected in (("3 4\n", "12"), ("5 6\n", "30")):
        payload = {
            "compile_timeout": 10,
            "run_timeout": 10,
            "code": code,
            "stdin": stdin,
            "language": "python",
            "files": {},
            "fetch_files": [],
        }
        r = post(sandbox, payload, {"Accept": "application/json"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "Success"
        assert body["run_result"]["stdout"].rstrip("\n") == expected
    # newer verl adds the memory limit
    r = post(sandbox, {**payload, "memory_limit_MB": 256})
    assert r.status_code == 200 and r.json()["status"] == "Success"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"code": "print(1)", "language": "cobol"}, "language"),
        ({"code": "", "language": "python"}, "code"),
        ({"code": "print(1)", "language": "python", "files": {"a.txt": "not base64!"}}, "files"),
        ({"code": "print(1)", "language": "python", "files": {"/etc/x": b64("x")}}, "files"),
        ({"code": "print(1)", "language": "python", "files": {"a/../../x": b64("x")}}, "files"),
        ({"code": "print(1)", "language": "python", "files": {"a": b64("x"), "a/b": b64("y")}}, "files"),
        ({"code": "print(1)", "language": "python", "fetch_files": ["/etc/passwd"]}, "fetch_files"),
        ({"code": "print(1)", "language": "python", "fetch_files": ["../x"]}, "fetch_files"),
        ({"code": "print(1)", "language": "python", "run_timeout": 0}, "run_timeout"),
        ({"code": "print(1)", "language": "python", "run_timeout": -1}, "run_timeout"),
        ({"code": "print(1)", "language": "python", "run_timeout": 100000}, "run_timeout"),
        ({"code": "print(1)", "language": "python", "compile_timeout": 0}, "compile_timeout"),
        ({"code": "print(1)", "language": "python", "compile_timeout": 1e9}, "compile_timeout"),
        ({"code": "print(1)", "language": "python", "memory_limit_MB": 3}, "memory_limit_MB"),
        ({"code": "print(1)", "language": "python", "surprise": 1}, "surprise"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(sandbox, body: dict, field: str) -> None:
    r = post(sandbox, body)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert field in (error.get("field") or ""), error


@pytest.mark.parametrize(
    ("tests", "field"),
    [
        ({"kind": "asserts", "asserts": ["assert 1"]}, "tests.kind"),
        # Ignored for another language, these once let the run pass without the call or value.
        ({"kind": "run", "call": {"function": "f"}}, "tests.call"),
        ({"kind": "run", "value": "last_expression"}, "tests.value"),
        ({"kind": "run", "cells": ["1"]}, "tests.cells"),
    ],
)
def test_python_only_tests_are_refused_for_other_languages(sandbox, tests: dict, field: str) -> None:
    r = httpx.post(
        f"{sandbox.url}/v1/runs", json={"language": "bash", "code": "echo 1", "tests": tests}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text


def test_fetch_follows_no_link_out_of_the_run_directory(sandbox) -> None:
    code = "import os\nos.symlink('/etc/os-release', 'leak')\nos.symlink('/etc', 'dir')\n"
    out = post(
        sandbox, {"code": code, "language": "python", "fetch_files": ["leak", "dir/os-release"]}
    ).json()
    assert out["status"] == "Success" and out["files"] == {}


def test_same_keys_as_v1_runs() -> None:
    env = {
        "CRUCIBLE_SANDBOX_WORKERS": "1",
        "CRUCIBLE_SANDBOX_API_KEYS": "fusion-key-0123456789abcdef",
        "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE + 52),  # apart from this process's other sandboxes
    }
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as sandbox:
        body = {"code": "print(1)", "language": "python"}
        assert post(sandbox, body).status_code == 401
        assert post(sandbox, body, {"Authorization": "Bearer wrong-key-0123456789abcdef"}).status_code == 401
        r = post(sandbox, body, {"Authorization": "Bearer fusion-key-0123456789abcdef"})
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n"


def test_jupyter_cells_share_state_in_one_process(sandbox) -> None:
    cells = [
        "import os\na = 123\npid = os.getpid()",
        "a",
        "print(a + 1)",
        'import sys; sys.stderr.write("stderr message")',
        'raise RuntimeError("error message")',
        "a * 2, os.getpid() == pid, open('in.txt').read()",
        "open('out.txt', 'w').write('from cell 7')",
        "def f(:",
        "None",
    ]
    request = RunJupyterRequest(cells=cells, files={"in.txt": b64("given")}, fetch_files=["out.txt"])
    out = run_jupyter(request, endpoint=sandbox.url, max_attempts=1)
    assert out.status == RunStatus.Success, out
    assert out.driver.status == CommandRunStatus.Finished
    assert len(out.cells) == len(cells)
    assert out.cells[1].display == [{"text/plain": "123"}]
    assert out.cells[2].stdout == "124\n" and out.cells[2].display == []
    assert out.cells[3].stderr == "stderr message"
    assert (
        out.cells[4].error[0]["ename"] == "RuntimeError"
        and out.cells[4].error[0]["evalue"] == "error message"
    )
    assert any("error message" in line for line in out.cells[4].error[0]["traceback"])
    assert out.cells[5].display == [{"text/plain": "(246, True, 'given')"}]  # one process, state kept
    assert out.cells[7].error[0]["ename"] == "SyntaxError"
    assert out.cells[8].display == [] and out.cells[8].error == []
    assert base64.b64decode(out.files["out.txt"]) == b"from cell 7"


def test_jupyter_cell_and_total_timeouts(sandbox) -> None:
    cells = ["import time\nx = 1", "while True:\n    pass", "x + 1", "time.sleep(30)", "x + 2"]
    request = RunJupyterRequest(cells=cells, cell_timeout=0.5, total_timeout=20)
    out = asyncio.run(run_jupyter_async(request, endpoint=sandbox.url, max_attempts=1))
    assert out.status == RunStatus.Success
    assert out.cells[1].error[0]["ename"] == "TimeoutError"  # interrupted, and the session goes on
    assert out.cells[2].display == [{"text/plain": "2"}]
    assert out.cells[3].error[0]["ename"] == "TimeoutError"
    assert out.cells[4].display == [{"text/plain": "3"}]
    # The whole session's limit: the cells after it do not run, and the process is gone.
    request = RunJupyterRequest(cells=["y = 1", "while True:\n    pass", "y"], total_timeout=1)
    out = run_jupyter(request, endpoint=sandbox.url, max_attempts=1)
    assert out.status == RunStatus.Failed and out.driver.status == CommandRunStatus.TimeLimitExceeded
    assert len(out.cells) == 1


@pytest.fixture(params=["full", "landlock"])
def sandbox_mode(request, sandbox):
    """The session's sandbox (full isolation), and one in the Landlock fallback."""
    if request.param == "full":
        yield sandbox
        return
    env = {
        "CRUCIBLE_SANDBOX_WORKERS": "1",
        "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE + 60),  # apart from this process's other sandboxes
        "CRUCIBLE_SANDBOX_MOUNT_NAMESPACE": "false",
    }
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as service:
        yield service


def test_jupyter_cell_timeout_holds_against_a_cell_that_ignores_its_timer(sandbox_mode) -> None:
    """The cell's own timer turned off: the worker ends the session at the cell's time, not the total."""
    cells = [
        "import os\nx = 1\npid = os.getpid()",
        "pid",
        "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass",
        "x + 1",
    ]
    request = RunJupyterRequest(cells=cells, cell_timeout=1, total_timeout=30)
    started = time.monotonic()
    out = run_jupyter(request, endpoint=sandbox_mode.url, max_attempts=1)
    took = time.monotonic() - started
    assert took < 1 + 1.5, f"the session ran {took:.1f} s past a cell time of 1 s"
    assert out.status == RunStatus.Failed and out.driver.status == CommandRunStatus.TimeLimitExceeded
    assert "cell 2" in out.message
    assert len(out.cells) == 3  # the cell after the one that ran out did not run
    assert out.cells[1].display and out.cells[1].error == []
    assert out.cells[2].error[0]["ename"] == "TimeoutError"
    pid = int(out.cells[1].display[0]["text/plain"])
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "the session's process outlived the call"


def test_jupyter_session_processes_end_with_the_call(sandbox) -> None:
    cells = [
        "import subprocess\nchild = subprocess.Popen(['sleep', '60'], start_new_session=True)",
        "child.pid, os.getpid() if (os := __import__('os')) else 0",
    ]
    out = run_jupyter(RunJupyterRequest(cells=cells), endpoint=sandbox.url, max_attempts=1)
    assert out.status == RunStatus.Success, out
    pids = [int(p) for p in out.cells[1].display[0]["text/plain"].strip("()").split(",")]
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], (
        "a session's process outlived the call"
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"cells": []}, "cells"),
        ({"cells": ["1"], "total_timeout": 0}, "total_timeout"),
        ({"cells": ["1"], "total_timeout": 1e6}, "total_timeout"),
        ({"cells": ["1"], "cell_timeout": -1}, "cell_timeout"),
        ({"cells": ["1"], "kernel": "ruby"}, "kernel"),
        ({"cells": ["1"], "files": {"../x": b64("x")}}, "files"),
    ],
)
def test_jupyter_bad_input(sandbox, body: dict, field: str) -> None:
    r = httpx.post(f"{sandbox.url}/run_jupyter", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    assert field in (r.json()["error"].get("field") or "")
