"""Tiny random-weight checkpoints of every model family users train, and transformers' answers on them.

Each family is built from its own transformers config (2 layers, hidden 64, the shapes' other
ratios as in the released models: grouped or full key/value heads, tied or untied embeddings,
sliding windows, soft-capping) with seeded random weights, saved with the built-in model's
tokenizer (SmolLM2's, 49,152 tokens: the vocabulary of every tiny config) so that servers, the
trainer and transformers all load the same directory. Where the built-in model is not installed
(a GPU lease that carried only Qwen2.5-Coder-1.5B-Instruct), the installed Qwen's tokenizer is
taken instead and the configs' vocabulary grows to hold it. `family_checkpoints` (registered in
tests/conftest.py) builds each family at most once per test session, on first use, under a
session temporary directory.

The reference is transformers itself: `hf_greedy` decodes with `generate` on a model loaded from
the directory (`from_pretrained`, attention chosen by transformers), optionally with a PEFT
adapter on top, one prompt at a time (no padding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
}

# name -> (transformers model_type, config overrides): what distinguishes the family's released models.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"tie_word_embeddings": False}),  # Llama-3-8B
    "llama-tied": ("llama", {"tie_word_embeddings": True}),  # Llama-3.2-1B, SmolLM2
    "qwen2": ("qwen2", {"tie_word_embeddings": False}),  # Qwen2.5-7B: q/k/v biases
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),  # Qwen2.5-0.5B/1.5B
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),  # Qwen3-0.6B: q/k norms
    # Gemma-2: soft-capped attention and logits, sliding and global layers, `1 + weight` norms,
    # scaled embeddings, no SDPA in transformers.
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    # Gemma-3 (text): one sliding layer of 512 tokens (gemma-3-1b) and one global, q/k norms.
    "gemma3": (
        "gemma3_text",
        {
            "query_pre_attn_scalar": 16,
            "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # Phi-3: fused qkv and gate/up projections, full multi-head attention, a 2047-token window
    # (Phi-3-mini-4k).
    "phi3": ("phi3", {"num_key_value_heads": 4, "sliding_window": 2047, "head_dim": None}),
    "mistral": ("mistral", {"sliding_window": 4096}),  # Mistral-7B-v0.1
    # gpt-oss: attention sinks, biases, mixture-of-experts MLPs, sliding and global layers (the
    # released models slide over 128 tokens, which the fast path refuses: less than a row bucket).
    "gpt-oss": (
        "gpt_oss",
        {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 256},
    ),
}

PROMPTS = [
    "def add(a, b):\n    return",
    "Write a Python function that reverses a string.",
    "# sort a list\nxs = [3, 1, 2]\n",
]


def family_config(name: str, tokenizer: Any | None = None) -> Any:
    """The tiny transformers config of family `name`."""
    from transformers import AutoConfig

    model_type, overrides = FAMILIES[name]
    values = {**TINY, **overrides}
    values = {k: v for k, v in values.items() if v is not None}
    if tokenizer is not None:
        values.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            vocab_size=max(values["vocab_size"], len(tokenizer)),  # every id it can give is embedded
        )
    return AutoConfig.for_model(model_type, **values)


def save_checkpoint(config: Any, out: Path, tokenizer: Any, seed: int, dtype: Any = None) -> Path:
    """Random weights for `config` (seeded), saved with `tokenizer` as a `from_pretrained` directory."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_family(name: str, root: Path, seed: int = 0, tokenizer: Any = None) -> Path:
    """Family `name`'s tiny checkpoint under `root/name` (random weights seeded by `seed`), with
    `tokenizer` (default: the built-in model's, else the installed Qwen's: `shape_tokenizer`)."""
    from bench.model_shapes import shape_tokenizer

    tokenizer = tokenizer or shape_tokenizer()
    return save_checkpoint(family_config(name, tokenizer), root / name, tokenizer, seed)


def save_lora(
    model_dir: Path,
    out: Path,
    seed: int,
    rank: int = 8,
    scale: float = 0.05,
    device: str = "cpu",
    dtype: Any = None,
) -> str:
    """A rank-`rank` all-linear LoRA adapter for the model in `model_dir`, with random `lora_B`
    (PEFT initialises it to zero, which would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32).to(device)
    torch.manual_seed(seed)
    peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    with torch.no_grad():
        for param_name, param in peft.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0, scale)
    peft.save_pretrained(out)
    return str(out)


def hf_model(
    model_dir: Path | str, adapter: str | None = None, device: str = "cpu", dtype: Any = None
) -> Any:
    """transformers' model from `model_dir` (plus a PEFT adapter), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32).to(device)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate`, never stopping early (as `ignore_eos` does)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None, pad_token_id=0
    )
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()


def hf_logits(model: Any, ids: list[int]) -> Any:
    """Float32 logits of every position of `ids`."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()


class FamilyCheckpoints:
    """Builds each family's checkpoint once, on first use (`get`), under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}
        self._tokenizer: Any = None

    def get(self, name: str) -> Path:
        if name not in self._built:
            if self._tokenizer is None:
                from bench.model_shapes import shape_tokenizer

                self._tokenizer = shape_tokenizer()
            seed = sorted(FAMILIES).index(name)
            self._built[name] = build_family(name, self.root, seed, self._tokenizer)
        return self._built[name]

    def adapter(self, name: str, version: int = 1) -> str:
        """A random rank-8 all-linear LoRA adapter of family `name` (seeded by `version`)."""
        out = self.root / f"{name}-lora-v{version}"
        if not (out / "adapter_config.json").is_file():
            save_lora(self.get(name), out, seed=100 + version)
        return str(out)


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> FamilyCheckpoints:
    return FamilyCheckpoints(tmp_path_factory.mktemp("families"))
