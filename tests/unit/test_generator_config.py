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


def test_max_batch_size_is_auto_by_default_or_a_number(monkeypatch):
    assert Settings().max_batch_size == "auto"
    monkeypatch.setenv("CRUCIBLE_GENERATOR_MAX_BATCH_SIZE", "96")
    assert Settings().max_batch_size == 96
    for bad in ("big", "0", "-3"):
        monkeypatch.setenv("CRUCIBLE_GENERATOR_MAX_BATCH_SIZE", bad)
        with pytest.raises(ValueError, match="max_batch_size"):
            Settings()


def test_auto_batch_size_follows_free_memory_and_the_model_s_cache():
    from types import SimpleNamespace

    from crucible_generator.sizing import BOUNDS, batch_from_memory, kv_bytes_per_token

    smol = SimpleNamespace(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576
    )
    wide = SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, hidden_size=4096)  # no GQA
    per_token = kv_bytes_per_token(smol, 2)
    assert kv_bytes_per_token(wide, 2) == 2 * 32 * 32 * 128 * 2
    sizes = [batch_from_memory(gib * 2**30, per_token, 8192) for gib in (0, 1, 4, 16, 80)]
    assert sizes == sorted(sizes) and sizes[0] == BOUNDS[0] and sizes[-1] == BOUNDS[1]
    assert all(s & (s - 1) == 0 for s in sizes)  # powers of two
    # The caches chosen fit in the share of free memory the module promises.
    assert batch_from_memory(4 * 2**30, per_token, 8192) * per_token * 2048 <= 0.4 * 4 * 2**30
    # A wider cache per token leaves room for fewer sequences; a shorter context for more.
    assert batch_from_memory(16 * 2**30, kv_bytes_per_token(wide, 2), 8192) < sizes[3]
    assert batch_from_memory(1 * 2**30, per_token, 512) > sizes[1]


def test_auto_batch_size_on_a_cpu_is_the_cpu_default():
    import torch
    from crucible_generator.sizing import CPU_BATCH, free_memory_plan

    model = torch.nn.Linear(2, 2)
    model.device = torch.device("cpu")  # what a transformers model exposes
    assert free_memory_plan(model, 2048, None, 16, paged=True).rows == CPU_BATCH


def test_paged_cache_from_free_memory_leaves_room_for_rows_of_average_length():
    from crucible_generator.sizing import BOUNDS, MIN_AVERAGE, SHARE_OF_FREE, paged_from_memory

    per_token = 23040  # SmolLM2 in bf16
    plans = [paged_from_memory(gib * 2**30, per_token, 16, None) for gib in (0, 1, 4, 16, 80)]
    rows = [p.rows for p in plans]
    assert rows == sorted(rows) and rows[0] == BOUNDS[0] and rows[-1] == BOUNDS[1]
    for gib, plan in zip((0, 1, 4, 16, 80), plans, strict=True):
        assert plan.tokens * per_token <= SHARE_OF_FREE * gib * 2**30  # the share the module promises
        assert plan.rows == BOUNDS[0] or plan.rows * MIN_AVERAGE <= plan.tokens
    assert paged_from_memory(16 * 2**30, per_token, 16, 40).rows == 40  # a set max_batch_size
