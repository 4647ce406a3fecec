"""`crucible up` / the demo pick vLLM where it is there, with the compose GPU generator's launch profile."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from crucible_cli import generator_backend as gb

SERVE_SH = Path(__file__).resolve().parents[2] / "services" / "generator" / "vllm" / "serve.sh"


def test_auto_picks_vllm_only_with_cuda_and_vllm(monkeypatch):
    for vllm, cuda, want in ((True, True, "vllm"), (True, False, "crucible"), (False, True, "crucible")):
        monkeypatch.setattr(gb, "has_vllm", lambda v=vllm: v)
        monkeypatch.setattr(gb, "has_cuda", lambda c=cuda: c)
        assert gb.pick("auto") == want
        assert gb.pick(None) == want  # no setting: auto


def test_forcing_a_backend(monkeypatch):
    monkeypatch.setattr(gb, "has_vllm", lambda: False)
    assert gb.pick("crucible") == "crucible"
    with pytest.raises(ValueError, match="vllm package is not installed"):
        gb.pick("vllm")
    monkeypatch.setenv("CRUCIBLE_GENERATOR_BACKEND", "crucible")
    monkeypatch.setattr(gb, "has_vllm", lambda: True)
    monkeypatch.setattr(gb, "has_cuda", lambda: True)
    assert gb.pick(None) == "crucible"  # the environment forces it
    with pytest.raises(ValueError, match="use one of auto, vllm, crucible"):
        gb.pick("tgi")


def test_the_profile_is_the_images_launch_profile():
    script = SERVE_SH.read_text()
    defaults = {
        flag: value
        for flag, value in re.findall(r'(--[a-z-]+) "\$\{[A-Z_]+:-(?:\$\{[A-Z_]+:-)?([^}"]+)\}', script)
    }
    switches = set(re.findall(r"(--[a-z-]+) \\$", script, re.M))
    assert set(gb.PROFILE_SWITCHES) <= switches
    assert {"--max-loras", "--max-lora-rank", "--max-cpu-loras", "--max-model-len"} <= set(defaults)
    for flag, value in gb.PROFILE.items():
        if flag == "--gpu-memory-utilization":  # the local stack shares the card with the trainer
            continue
        assert defaults.get(flag, script.split(flag)[1].split()[0]) == value, flag


def test_the_builtin_model_is_served_from_its_dense_copy_under_its_name():
    command = gb.vllm_command("smollm2-135m-instruct", "smollm2-135m-instruct", 8123)
    path = command[command.index("serve") + 1]
    assert (Path(path) / "config.json").is_file()
    assert command[command.index("--served-model-name") + 1] == "smollm2-135m-instruct"
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert "--enable-lora" in command and command[command.index("--port") + 1] == "8123"


def test_the_image_pins_the_vllm_release_the_fixtures_were_recorded_from():
    root = Path(__file__).resolve().parents[2]
    pinned = re.search(
        r"^FROM vllm/vllm-openai:v([\d.]+)$", (root / "services/generator/vllm/Dockerfile").read_text(), re.M
    )
    recorded = re.search(
        r"real vLLM ([\d.]+) OpenAI-compatible", (root / "tests/fixtures/vllm/README.md").read_text()
    )
    assert pinned and recorded and pinned.group(1) == recorded.group(1) == "0.22.0"
