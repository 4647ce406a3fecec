"""The `crucible` command line against spawned services."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from crucible_shared.gateway_client import GatewayClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def crucible(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crucible_cli", *args], capture_output=True, text=True, timeout=120
    )


def test_submit_list_and_cancel(gateway) -> None:
    out = crucible(
        "train", "--config", str(EXAMPLES / "grpo_tiny.yaml"), "--gateway", gateway.url, "--detach"
    )
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split()[1]
    assert GatewayClient(gateway.url).job(job_id).status == "queued"
    out = crucible(
        "eval", "--config", str(EXAMPLES / "eval_mbpp_test.yaml"), "--gateway", gateway.url, "--detach"
    )
    assert out.returncode == 0, out.stderr
    listing = crucible("jobs", "--gateway", gateway.url)
    assert job_id in listing.stdout
    for line in (job_id, out.stdout.split()[1]):
        cancelled = crucible("cancel", line, "--gateway", gateway.url)
        assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout


def test_overrides_reach_the_gateway(gateway) -> None:
    out = crucible(
        "train",
        "-c",
        str(EXAMPLES / "grpo_tiny.yaml"),
        "--set",
        "optim.lr=3e-5",
        "--set",
        "method.group_size=4",
        "--gateway",
        gateway.url,
        "--detach",
    )
    assert out.returncode == 0, out.stderr
    client = GatewayClient(gateway.url)
    job = client.job(out.stdout.split()[1])
    assert job.spec["optim"]["lr"] == 3e-5 and job.spec["method"]["group_size"] == 4
    client.cancel(job.id)


def test_bad_spec_and_unreachable_gateway_are_clear(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: train\noptim: {lr: -1}\n")
    out = crucible("train", "--config", str(bad))
    assert out.returncode == 2 and "optim.lr" in out.stderr and "Traceback" not in out.stderr
    out = crucible("train", "--config", str(EXAMPLES / "grpo_tiny.yaml"), "--gateway", "http://127.0.0.1:9")
    assert out.returncode == 1 and "cannot reach the gateway" in out.stderr and "crucible up" in out.stderr
    out = crucible("train", "--config", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_sandbox_run(sandbox, tmp_path) -> None:
    program = tmp_path / "prog.py"
    program.write_text("def add(a, b):\n    return a - b\n")
    tests = tmp_path / "tests.py"
    tests.write_text("assert add(2, 2) == 4\nassert add(0, 0) == 0\n")
    out = crucible("sandbox", "run", str(program), "--tests", str(tests), "--sandbox", sandbox.url)
    assert out.returncode == 1
    assert "1/2 tests passed" in out.stdout and "got 0" in out.stdout


def test_a_stored_name_with_escape_sequences_is_listed_escaped(gateway, redis_url, monkeypatch) -> None:
    """Specs refuse such names now; a record written before keeps its name, and `crucible jobs`
    shows it escaped instead of sending its escape sequences (or rich markup) to the terminal."""
    from crucible_shared import keys
    from redis import Redis

    monkeypatch.setenv("COLUMNS", "250")  # one table row per job
    job_id = GatewayClient(gateway.url).submit({"kind": "eval", "name": "plain"}).id
    hostile = "\x1b[2J\x1b[31mowned\u202etxt.exe [bold]x[/bold]"
    Redis.from_url(redis_url).hset(keys.job(job_id), "name", hostile)
    try:
        listing = crucible("jobs", "--gateway", gateway.url)
        assert listing.returncode == 0, listing.stderr
        assert "\x1b" not in listing.stdout and "\u202e" not in listing.stdout, listing.stdout
        assert "\\x1b[2J" in listing.stdout and "[bold]" in listing.stdout, listing.stdout
    finally:
        GatewayClient(gateway.url).cancel(job_id)
