"""A program must never turn its run into `sandbox_error`, nor leave anything behind.

Values whose comparison raises, garbage or oversized frames on the report channel, lone
surrogates, zero denominators: each is a verdict about the program. The report channel is capped;
the memory limit holds for the whole run; nothing a run writes survives it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import httpx
import pytest

from tests.integration import sandbox_programs as hostile
from tests.integration.conftest import UID_BASE
from tests.servers import spawn

FULL = os.geteuid() == 0


def _run_batch(sandbox, runs: list[dict]) -> list[dict]:
    r = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def _in_every_form(code: str, **limits) -> list[dict]:
    runs = [{"code": code, "tests": tests, "use_cache": False} for tests in hostile.FORMS.values()]
    if limits:
        for run in runs:
            run["limits"] = limits
    return runs


FORGE = hostile._FORGE
GARBAGE: dict[str, str] = {
    "signalling-nan": "import decimal\ndef add(a, b):\n    return decimal.Decimal('sNaN')\n",
    "nan-in-a-set": "import decimal\ndef add(a, b):\n    return {decimal.Decimal('sNaN'), 1}\n",
    "garbage-bytes": (
        "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'\\xff\\xff\\xff\\xffgarbage')\n"
        "    except OSError:\n        pass\ndef add(a, b):\n    return a + b\n"
    ),
    "garbage-then-exit": (
        "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'\\x00\\x00\\x00\\x05{{{{{')\n"
        "    except OSError:\n        pass\nos._exit(0)\n"
    ),
    "oversized-frame-header": (
        "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'\\x7f\\xff\\xff\\xff')\n"
        "    except OSError:\n        pass\nos._exit(0)\n"
    ),
    "lone-surrogate-value": "def add(a, b):\n    return '\\ud800' * (a + b)\n",
    "lone-surrogate-exception": "def add(a, b):\n    raise ValueError('\\udfff' + str(a))\n",
    "lone-surrogate-print": "import sys\nsys.stdout.buffer.write(b'\\xed\\xa0\\x80\\n')\ndef add(a, b):\n    return a + b\n",
    "lone-surrogate-frames": FORGE
    + (
        "for t in ('crash', 'setup_error', 'exit', 'test'):\n"
        "    _forge({'t': t, 'i': 0, 'exc': '\\ud800', 'msg': '\\ud800', 'tb': '\\udfff', 'code': '\\ud800',\n"
        "            'status': 'error', 'value': ['str', '\\ud800'], 'names': ['\\ud800']})\n"
        "os._exit(0)\n"
    ),
    "zero-denominator-frames": FORGE
    + (
        "for i in range(3):\n"
        "    _forge({'t': 'test', 'i': i, 'status': 'passed', 'value': ['Fraction', '0x1', '0x0'],\n"
        "            'actuals': {str(i): {'value': ['Fraction', '0x1', '0x0']}}})\n"
        "    _forge({'seq': i, 'ok': ['Fraction', '0x1', '0x0']})\n"
        "os._exit(0)\n"
    ),
    "malformed-values": FORGE
    + (
        "for v in (['int', 'zz'], ['list', 5], ['Decimal', 'x'], ['float', '0x1p99999999'], ['ref', -1], 7):\n"
        "    _forge({'t': 'test', 'i': 0, 'value': v, 'actuals': {'0': {'value': v}}})\n"
        "    _forge({'seq': 1, 'ok': v})\n"
        "def add(a, b):\n    return a + b\n"
    ),
}


@pytest.mark.parametrize("program", sorted(GARBAGE))
def test_garbage_from_the_program_is_a_verdict_about_it(sandbox, program) -> None:
    for form, result in zip(
        hostile.FORMS, _run_batch(sandbox, _in_every_form(GARBAGE[program])), strict=True
    ):
        assert result["status"] != "sandbox_error", f"{program} ({form}): {result['message']}"
        # These values are true: `assert add(1, 1)` holds for them.
        truthy = form == "asserts-truth" and program in ("signalling-nan", "lone-surrogate-value")
        if program not in ("garbage-bytes", "lone-surrogate-print", "malformed-values") and not truthy:
            assert result["status"] != "passed", (program, form, result)


def test_report_channel_is_capped(sandbox) -> None:
    # 256 MiB of frames the worker would otherwise buffer whole.
    flood = (
        "import os\nchunk = b'\\x00\\x00\\x00\\x02{}' * (1 << 18)\n"
        "for fd in range(3, 64):\n    try:\n        for _ in range(256):\n            os.write(fd, chunk)\n"
        "    except OSError:\n        pass\ndef add(a, b):\n    return a + b\n"
    )
    runs = _in_every_form(flood, wall_time_s=20, test_time_s=20)
    for form, result in zip(hostile.FORMS, _run_batch(sandbox, runs), strict=True):
        assert result["status"] == "output_exceeded", (form, result["status"], result["message"])


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the per-run memory limit is tested where the sandbox runs as root")
def test_memory_limit_holds_for_the_whole_run(sandbox) -> None:
    tests = {"kind": "asserts", "asserts": ["assert answer(1) == 7"]}
    limits = {"memory_mb": 256, "wall_time_s": 20, "test_time_s": 20}
    (out,) = _run_batch(sandbox, [{"code": hostile.SEVEN_PROCESSES, "tests": tests, "limits": limits}])
    assert out["status"] == "memory_exceeded", (out["status"], out["message"])
    # One process alone still gets its limit and a MemoryError.
    one = "def answer(x):\n    return len(bytearray(300 << 20))\n"
    (out,) = _run_batch(sandbox, [{"code": one, "tests": tests, "limits": limits, "use_cache": False}])
    assert out["status"] == "memory_exceeded" and out["tests"][0]["exception_type"] == "MemoryError"


@pytest.mark.skipif(not FULL, reason="needs the full isolation mode (root)")
def test_nothing_written_outside_scratch_survives_the_run(sandbox) -> None:
    marker = f"crucible-outlive-{secrets.token_hex(4)}"
    tests = {"kind": "asserts", "asserts": ["assert answer(1) == []"]}
    (wrote,) = _run_batch(
        sandbox, [{"code": hostile.outlive_writer(marker), "tests": tests, "use_cache": False}]
    )
    reads = _run_batch(
        sandbox,
        [{"code": hostile.outlive_reader(marker), "tests": tests, "use_cache": False} for _ in range(4)],
    )
    leaked = sorted(
        {os.path.realpath(Path(d, marker)) for d in hostile.OUTLIVE_DIRS if Path(d, marker).exists()}
    )
    for path in leaked:
        Path(path).unlink(missing_ok=True)
    assert wrote["status"] == "passed", f"the run could write to {wrote['tests'][0].get('actual')}"
    assert leaked == []
    assert all(r["status"] == "passed" for r in reads), [r["message"] for r in reads]


def test_whatever_a_run_leaves_in_scratch_the_next_run_starts_clean(sandbox) -> None:
    # Directories nested thousands deep: deleting them one by one recursively would fail.
    deep = (
        "import os\ndef answer(x):\n    os.chdir(os.environ.get('TMPDIR', '/tmp'))\n"
        "    for i in range(3000):\n        os.mkdir('d')\n        os.chdir('d')\n    return 0\n"
    )
    tests = {"kind": "asserts", "asserts": ["assert answer(1) == 0"]}
    runs = [
        {"code": deep, "tests": tests, "use_cache": False, "limits": {"wall_time_s": 20, "test_time_s": 20}}
    ] * 2
    after = [{"code": "def answer(x):\n    return 0\n", "tests": tests, "use_cache": False}] * 4
    results = _run_batch(sandbox, runs) + _run_batch(sandbox, after)
    assert [r["status"] for r in results] == ["passed"] * 6, [r["message"] for r in results]


@pytest.mark.skipif(not FULL, reason="needs the full isolation mode (root)")
def test_ipc_objects_do_not_survive_the_run(sandbox) -> None:
    key = 0x5EED0000 + secrets.randbelow(1 << 16)
    made = {"kind": "asserts", "asserts": ["assert answer(1) == True"]}
    absent = {"kind": "asserts", "asserts": ["assert answer(1) == []"]}
    (wrote,) = _run_batch(sandbox, [{"code": hostile.ipc_writer(key), "tests": made, "use_cache": False}])
    assert wrote["status"] == "passed", wrote
    reads = _run_batch(sandbox, [{"code": hostile.ipc_reader(key), "tests": absent, "use_cache": False}] * 4)
    on_host = [
        line
        for name in ("shm", "msg", "sem")
        for line in Path(f"/proc/sysvipc/{name}").read_text().splitlines()[1:]
        if int(line.split()[0]) == key
    ]
    assert on_host == [] and all(r["status"] == "passed" for r in reads), (on_host, reads[0]["message"])


# -- the API and the service --------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_body_sandbox():
    env = {
        "CRUCIBLE_SANDBOX_WORKERS": "1",
        "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE + 40),
        "CRUCIBLE_SANDBOX_MAX_BODY_BYTES": str(1 << 20),
    }
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as service:
        yield service


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/runs/batch"])
def test_chunked_body_is_limited_while_it_is_read(small_body_sandbox, path) -> None:
    sent = [0]

    def body():
        yield b'{"code": "'
        for _ in range(64):  # 4 MiB, four times the limit, with no Content-Length
            sent[0] += 1 << 16
            yield b"x" * (1 << 16)
        yield b'", "tests": {"kind": "asserts", "asserts": ["assert 1"]}}'

    r = httpx.post(
        f"{small_body_sandbox.url}{path}",
        content=body(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["field"] == "body"


def test_unisolated_root_refuses_to_start_without_the_unsafe_flag() -> None:
    if not FULL:
        pytest.skip("only root can run programs as uid 0")
    env = {"CRUCIBLE_SANDBOX_WORKERS": "1", "CRUCIBLE_SANDBOX_ISOLATE": "false"}
    with (
        pytest.raises(RuntimeError, match="exited"),
        spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT", timeout=30),
    ):
        pass
    env["CRUCIBLE_SANDBOX_UNSAFE_NO_ISOLATION"] = "true"
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as svc:
        isolation = httpx.get(f"{svc.url}/health").json()["isolation"]
        assert isolation["mode"] == "unsafe" and "uid 0" in isolation["warning"]


def _cgroup_parents() -> list[Path]:
    """Where the sandbox may create its cgroups: the v2 hierarchy and a v1 memory hierarchy."""
    parents = []
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if parts[2] == "cgroup2" or (parts[2] == "cgroup" and "memory" in parts[3].split(",")):
            parents.append(Path(parts[1]))
    found = []
    for mount in parents:
        found += [p for p in mount.rglob("crucible-sandbox") if p.is_dir()]
    return found


def _subdirs(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.is_dir()}


@pytest.mark.skipif(not FULL, reason="cgroups are created where the sandbox runs as root")
def test_stopping_removes_the_cgroup_directories() -> None:
    env = {"CRUCIBLE_SANDBOX_WORKERS": "2", "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE + 44)}
    before = {p: _subdirs(p) for p in _cgroup_parents()}
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as svc:
        body = {"code": "def f(): return 1", "tests": {"kind": "asserts", "asserts": ["assert f() == 1"]}}
        assert httpx.post(f"{svc.url}/v1/runs", json=body, timeout=30).json()["status"] == "passed"
        during = {p: _subdirs(p) for p in _cgroup_parents()}
        owner = f"s{svc.proc.pid}-"  # this server's slots; other sandboxes may start and stop meanwhile
    after = {p: _subdirs(p) for p in _cgroup_parents()}
    ours = {
        p: {n for n in names - before.get(p, set()) if n.startswith(owner)} for p, names in during.items()
    }
    assert any(ours.values()), f"no cgroup of this sandbox ({owner}*) found: {during}"
    for parent, names in ours.items():
        assert not (names & after.get(parent, set())), f"left behind in {parent}: {names & after[parent]}"
    for parent, names in after.items():
        assert names, f"an empty {parent} was left behind"
