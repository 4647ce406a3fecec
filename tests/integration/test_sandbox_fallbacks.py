"""The fallbacks, where the host refuses what the full mode uses.

* No mount namespace (`MOUNT_NAMESPACE=false`, or a host that denies mounts): Landlock confines
  each run to the interpreter, its standard library and its own scratch directory.
* No memory cgroup (`MEMORY_CGROUP=false`, or none delegated): the zygote samples the run's
  processes and kills the run past its memory limit.

The same hostile programs as the full mode's tests, against a sandbox started that way.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration import sandbox_programs as hostile
from tests.integration.conftest import UID_BASE
from tests.servers import spawn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the fallbacks are forced on a root host here"),
]


def _traversable(path: str) -> bool:
    """Whether other users can reach `path` (Landlock cannot open a 0700 /root for a run's uid)."""
    parts = os.path.realpath(path).strip("/").split("/")
    return all(os.stat("/" + "/".join(parts[:i])).st_mode & 0o001 for i in range(1, len(parts) + 1))


# Without a mount namespace a run's uid reaches the interpreter's files only through the host's
# permissions: an interpreter under /root (pyenv) leaves it the modules its zygote preloaded.
STDLIB_REACHABLE = _traversable(sys.base_prefix)
PRELOADED = {
    "bisect",
    "collections",
    "functools",
    "heapq",
    "itertools",
    "math",
    "re",
    "string",
    "sys",
    "typing",
    "os",
}


@pytest.fixture(scope="module")
def fallback_sandbox():
    env = {
        "CRUCIBLE_SANDBOX_WORKERS": "2",
        "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE + 48),
        "CRUCIBLE_SANDBOX_MOUNT_NAMESPACE": "false",
        "CRUCIBLE_SANDBOX_MEMORY_CGROUP": "false",
    }
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as service:
        yield service


def _batch(sandbox, runs: list[dict]) -> list[dict]:
    r = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def test_health_names_the_fallbacks(fallback_sandbox) -> None:
    isolation = httpx.get(f"{fallback_sandbox.url}/health").json()["isolation"]
    assert isolation["filesystem"] == "landlock", isolation
    assert isolation["memory"] == "sampled", isolation


@pytest.mark.parametrize("program", sorted(hostile.disk_finders()))
def test_landlock_hides_the_dataset_files(fallback_sandbox, program) -> None:
    tests = {"kind": "asserts", "asserts": ["assert answer(1) == []"]}
    run = {
        "code": hostile.disk_finders()[program],
        "tests": tests,
        "limits": {"wall_time_s": 30, "test_time_s": 30},
    }
    (out,) = _batch(fallback_sandbox, [run])
    assert out["status"] == "passed", out["message"]


def test_landlock_keeps_writes_in_the_scratch_directory(fallback_sandbox) -> None:
    marker = f"crucible-outlive-{secrets.token_hex(4)}"
    tests = {"kind": "asserts", "asserts": ["assert answer(1) == []"]}
    (wrote,) = _batch(fallback_sandbox, [{"code": hostile.outlive_writer(marker), "tests": tests}])
    leaked = [d for d in hostile.OUTLIVE_DIRS if Path(d, marker).exists()]
    for d in leaked:
        Path(d, marker).unlink(missing_ok=True)
    assert wrote["status"] == "passed" and leaked == [], (wrote["message"], leaked)
    scratch = "import os\ndef f():\n    with open(os.path.join(os.environ['TMPDIR'], 'there'), 'w') as t:\n        t.write('x')\n    os.unlink(os.path.join(os.environ['TMPDIR'], 'there'))\n    open('here', 'w').write('x')\n    return os.listdir('.')\n"
    (out,) = _batch(
        fallback_sandbox,
        [{"code": scratch, "tests": {"kind": "asserts", "asserts": ["assert f() == ['here']"]}}],
    )
    assert out["status"] == "passed", out["message"]


def test_a_deep_tree_in_a_run_directory_is_removed(fallback_sandbox) -> None:
    deep = "import os\ndef f():\n    for i in range(3000):\n        os.mkdir('d')\n        os.chdir('d')\n    return 0\n"
    tests = {"kind": "asserts", "asserts": ["assert f() == 0"]}
    runs = [{"code": deep, "tests": tests, "limits": {"wall_time_s": 30, "test_time_s": 30}}] * 2
    runs += [{"code": "def f():\n    return 0\n", "tests": tests}] * 2
    assert [r["status"] for r in _batch(fallback_sandbox, runs)] == ["passed"] * 4
    # What is left is the directory of each slot's next run, forked ahead and still empty.
    left = [p for p in Path("/tmp/crucible-sandbox").glob(f"s{fallback_sandbox.proc.pid}-*/run-*")]
    assert not [p for p in left if any(p.iterdir())], left


def test_references_still_pass_under_landlock(fallback_sandbox) -> None:
    rows = [json.loads(line) for line in hostile.MBPP.open()][10:60]
    if not STDLIB_REACHABLE:  # keep the tasks whose imports the zygote preloaded
        rows = [
            r
            for r in rows
            if not (set(re.findall(r"^\s*(?:from|import) (\w+)", r["code"], re.M)) - PRELOADED)
        ]
    runs = [
        {
            "code": r["code"],
            "tests": {"kind": "asserts", "asserts": r["test_list"], "setup": r["test_setup_code"]},
            "limits": {"test_time_s": 30, "wall_time_s": 60},
        }
        for r in rows
    ]
    imports = "import collections, decimal, fractions, heapq, itertools, json, math, re, string\n"
    if STDLIB_REACHABLE:
        imports += "import statistics, tempfile, csv, datetime\n"
    runs.append(
        {
            "code": imports + "def f():\n    return math.gcd(4, 6)\n",
            "tests": {"kind": "check", "check": "def check(c):\n    assert c() == 2\n", "entry_point": "f"},
        }
    )
    failing = [
        (i, r["message"]) for i, r in enumerate(_batch(fallback_sandbox, runs)) if r["status"] != "passed"
    ]
    assert failing == []


def test_sampled_memory_limit_holds_for_the_whole_run(fallback_sandbox) -> None:
    tests = {"kind": "asserts", "asserts": ["assert answer(1) == 7"]}
    limits = {"memory_mb": 256, "wall_time_s": 20, "test_time_s": 20}
    (out,) = _batch(fallback_sandbox, [{"code": hostile.SEVEN_PROCESSES, "tests": tests, "limits": limits}])
    assert out["status"] == "memory_exceeded", (out["status"], out["message"])


def test_expected_values_and_checking_code_hold_in_the_fallback(fallback_sandbox) -> None:
    secret = hostile.new_secret()
    runs = [
        {"code": code, "tests": tests, "limits": {"wall_time_s": 20, "test_time_s": 15}}
        for code in hostile.EXPECTED_IN_MEMORY.values()
        for form, tests in hostile.secret_forms(secret).items()
        if form != "stdio"
    ]
    runs += [{"code": code, "tests": hostile.FORMS["check"]} for code in hostile.TRUSTS_INTERPRETER.values()]
    for result in _batch(fallback_sandbox, runs):
        assert result["status"] not in ("passed", "sandbox_error"), result
