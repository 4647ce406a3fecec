"""Generator configuration: settings, the thin entry point, torch-free imports, the vLLM profile."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from crucible_generator.__main__ import parse_settings
from crucible_generator.settings import Settings

VLLM_DIR = Path(__file__).resolve().parents[2] / "services" / "generator" / "vllm"


def test_settings_read_the_environment(monkeypatch):
    monkeypatch.setenv("CRUCIBLE_GENERATOR_MAX_LORAS", "7")
    monkeypatch.setenv("CRUCIBLE_GENERATOR_SERVED_NAME", "ignored-unknown-field")
    settings = Settings()
    assert settings.max_loras == 7
    assert settings.base_model_name == "smollm2-135m-instruct"


def test_command_line_overrides_and_rejects_bad_values():
    assert (
        parse_settings(["--max-batch-size", "3", "--served-model-name", "policy"]).base_model_name == "policy"
    )
    with pytest.raises(SystemExit):
        parse_settings(["--max-loras", "0"])


def test_entry_point_and_shared_modules_do_not_import_torch():
    code = (
        "import sys, crucible_generator.__main__, crucible_models, crucible_shared.generator_client;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_is_instant():
    out = subprocess.run(
        [sys.executable, "-m", "crucible_generator", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    )
    assert "--max-loras" in out.stdout


def test_vllm_profile_has_the_contract_flags():
    script = (VLLM_DIR / "serve.sh").read_text()
    for flag in (
        "--enable-lora",
        "--max-loras",
        "--max-lora-rank",
        "--enable-prefix-caching",
        "--served-model-name",
    ):
        assert flag in script, flag
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in script
    subprocess.run(["bash", "-n", str(VLLM_DIR / "serve.sh")], check=True)


def test_vllm_image_is_based_on_vllm_openai_with_a_health_check():
    dockerfile = (VLLM_DIR / "Dockerfile").read_text()
    assert re.search(r"^FROM vllm/vllm-openai:v[\d.]+$", dockerfile, re.M)
    assert re.search(r"^ENV VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", dockerfile, re.M)
    assert re.search(r"HEALTHCHECK .*\n.*/health", dockerfile)
