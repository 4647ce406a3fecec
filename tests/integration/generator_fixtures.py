"""Fixtures for the generator tests: the real server with SmolLM2, the official `openai` client, and
two PEFT LoRA adapters with non-zero `lora_B` (so each changes what the model writes).

Registered for every integration test by `conftest.py`; the expensive objects are held in
`_shared` (one server and one set of adapters per test session, closed with their last user).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import openai
import pytest

from tests.servers import Service, spawn

BASE = "smollm2-135m-instruct"
MAX_LORAS = 4
MAX_LORA_RANK = 32
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

__all__ = ["BASE", "MAX_LORAS", "MAX_LORA_RANK", "client", "generator", "lora_dirs", "tokenizer"]


_shared: dict[str, list[Any]] = {}  # name -> [value, context manager, users]


@contextmanager
def shared(name: str, make: Callable[[], AbstractContextManager[Any]]) -> Iterator[Any]:
    """Enter `make()` once per session for all the modules that use `name`; exit after the last."""
    if name not in _shared:
        cm = make()
        _shared[name] = [cm.__enter__(), cm, 0]
    entry = _shared[name]
    entry[2] += 1
    try:
        yield entry[0]
    finally:
        entry[2] -= 1
        if entry[2] == 0:
            del _shared[name]
            entry[1].__exit__(None, None, None)


@pytest.fixture(scope="session")
def lora_dirs(tmp_path_factory) -> Iterator[dict[str, str]]:
    @contextmanager
    def make() -> Iterator[dict[str, str]]:
        yield make_adapters(tmp_path_factory.mktemp("adapters"))

    with shared("lora_dirs", make) as paths:
        yield paths


def make_adapters(root) -> dict[str, str]:
    """Adapters `v1` and `v2` (rank 8 on the attention projections) and `v3` (rank 16, all linears)."""
    import torch
    from crucible_models import load_model
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(BASE, device="cpu", dtype="float32")
    specs = {
        "v1": (1, LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION)),
        "v2": (2, LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION)),
        "v3": (3, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")),
    }
    paths = {}
    for name, (seed, config) in specs.items():
        peft_model = get_peft_model(model, config, adapter_name=name)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_B" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        peft_model.save_pretrained(root / name, selected_adapters=[name])
        # PEFT saves a non-default adapter in a subfolder named after it.
        saved = root / name / name if (root / name / name).is_dir() else root / name
        paths[name] = str(saved)
        model = peft_model.unload()
    too_big = root / "rank128"
    shutil.copytree(paths["v1"], too_big)
    config_file = too_big / "adapter_config.json"
    config_file.write_text(config_file.read_text().replace('"r": 8', '"r": 128'))
    paths["rank128"] = str(too_big)
    return paths


@pytest.fixture(scope="session")
def tokenizer():
    from crucible_models import load_tokenizer

    return load_tokenizer(BASE)


@pytest.fixture(scope="session")
def generator(lora_dirs, tmp_path_factory) -> Iterator[Service]:
    env = {
        # Every adapter of the tests lies under pytest's base temp dir (lora_dirs, tmp_path).
        "CRUCIBLE_GENERATOR_ADAPTER_ROOTS": str(tmp_path_factory.getbasetemp()),
        "CRUCIBLE_GENERATOR_MODEL": BASE,
        "CRUCIBLE_GENERATOR_DEVICE": "cpu",
        "CRUCIBLE_GENERATOR_MAX_LORAS": str(MAX_LORAS),
        "CRUCIBLE_GENERATOR_MAX_LORA_RANK": str(MAX_LORA_RANK),
        "CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": "16",
        "CRUCIBLE_GENERATOR_BATCH_WAIT_MS": "20",
        "CRUCIBLE_GENERATOR_LOG_LEVEL": "warning",
    }
    with shared(
        "generator", lambda: spawn("crucible_generator", env, "CRUCIBLE_GENERATOR_PORT", timeout=300)
    ) as service:
        yield service


@pytest.fixture(scope="session")
def client(generator) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{generator.url}/v1", api_key="unused", max_retries=0, timeout=120)
