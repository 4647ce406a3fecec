"""Model-name resolution and the once-only, race-safe conversion of the built-in GGUF model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import crucible_models as models


def test_other_names_pass_through(monkeypatch, tmp_path):
    monkeypatch.setenv("CRUCIBLE_CACHE_DIR", str(tmp_path))
    assert (
        models.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert not any(tmp_path.iterdir())


def test_a_local_model_directory_must_hold_a_checkpoint(monkeypatch, tmp_path):
    import pytest

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        models.resolve_model_path(str(tmp_path / "m"))  # not a hub lookup that hides the typo
    (tmp_path / "m" / "config.json").write_text("{}")
    assert models.resolve_model_path(str(tmp_path / "m")) == str(tmp_path / "m")
    assert models.resolve_model_path("~/m") == str(tmp_path / "m")


def test_builtin_gguf_ships_with_the_package():
    path = models.builtin_gguf_path("SmolLM2-135M-Instruct")
    assert path.name.endswith(".gguf") and path.stat().st_size > 10_000_000


def test_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CRUCIBLE_CACHE_DIR", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CRUCIBLE_CACHE_DIR")
    assert models.cache_dir() == Path.home() / ".cache" / "crucible"


def test_device_and_dtype_overrides():
    import torch

    assert models.pick_device("cpu") == "cpu"
    assert models.pick_dtype("cpu") == torch.float32
    assert models.pick_dtype("cuda", "bfloat16") == torch.bfloat16


def test_concurrent_conversions_leave_one_complete_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("CRUCIBLE_CACHE_DIR", str(tmp_path))
    conversions = []

    def fake_convert(gguf: Path, out: Path) -> None:
        conversions.append(out)
        time.sleep(0.2)  # long enough for every thread to be converting at once
        (out / "weights").write_text(str(out))
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(models.ensure_dense_checkpoint("smollm2-135m-instruct"))
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4
    target = results[0]
    assert (target / "config.json").is_file()
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp dirs left behind
    models.ensure_dense_checkpoint("smollm2-135m-instruct")
    assert len(conversions) == 4  # the cached copy is reused afterwards


def test_each_family_gets_an_attention_kernel_it_supports(family_checkpoints):
    import pytest

    gemma2, llama = str(family_checkpoints.get("gemma2")), str(family_checkpoints.get("llama"))
    assert models.pick_attention("auto", llama) == models.pick_attention(None, llama) == "sdpa"
    assert models.pick_attention("auto", gemma2) == "eager"  # transformers has no SDPA for it
    assert models.pick_attention("eager", llama) == "eager"
    with pytest.raises(ValueError, match=r"no SDPA attention for .*gemma2.*use auto or eager"):
        models.pick_attention("sdpa", gemma2)
    model, _ = models.load_model(gemma2, device="cpu")
    assert model.config._attn_implementation == "eager"
