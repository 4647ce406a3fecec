"""The `crucible` command from a laptop: a fresh virtualenv with only the slim packages (crucible-shared
and crucible-cli, no torch) submits jobs to a running gateway, and the commands that need the full
install say what to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from crucible_shared.gateway_client import GatewayClient
from crucible_shared.lifecycle import JobStatus

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slim_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("slim") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    done = subprocess.run(
        [*pip, str(ROOT / "shared"), str(ROOT / "cli")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def run(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / "crucible"), *args], capture_output=True, text=True, timeout=120
    )


def test_slim_install_has_no_heavy_packages(slim_venv: Path) -> None:
    probe = "import importlib.util as u; print([m for m in ('torch', 'transformers', 'peft', 'crucible_trainer') if u.find_spec(m)])"
    out = subprocess.run([str(slim_venv / "bin" / "python"), "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    help_text = run(slim_venv, "--help")
    assert help_text.returncode == 0 and "train" in help_text.stdout and "watch" in help_text.stdout


def test_slim_cli_submits_and_lists_jobs(slim_venv: Path, gateway) -> None:
    spec = ROOT / "examples" / "grpo_tiny.yaml"
    out = run(slim_venv, "train", "--config", str(spec), "--gateway", gateway.url, "--detach")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split()[1]
    client = GatewayClient(gateway.url)
    assert client.job(job_id).status == JobStatus.queued
    assert job_id in run(slim_venv, "jobs", "--gateway", gateway.url).stdout
    assert client.cancel(job_id).status == JobStatus.cancelled


def test_full_install_commands_say_what_to_install(slim_venv: Path, tmp_path: Path) -> None:
    for args in (["up"], ["train", "--config", str(ROOT / "examples" / "grpo_tiny.yaml"), "--local"]):
        out = run(slim_venv, *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert (
            "not installed" in out.stderr
            and "requirements.txt" in out.stderr
            and "Traceback" not in out.stderr
        )
