"""Stage `merge`: an adapter folded into its base model's weights, as a standalone model folder.

PEFT's `merge_and_unload` adds each LoRA delta (B @ A * alpha / r) to the weight it adapts, in
float32 on the CPU (exact, whatever dtype the result is saved in). The folder holds what
`from_pretrained`, Crucible's generator and vLLM load as a base model: `config.json`,
`model.safetensors`, `generation_config.json` and the tokenizer (with its chat template).
"""

from __future__ import annotations

from pathlib import Path

from crucible_trainer.runtime.atomic import output_dir


def merge_adapter(base: str, adapter: Path, out: Path, dtype: str | None = None) -> Path:
    """Write base + `adapter`, merged, to `out`; `dtype` defaults to the base checkpoint's."""
    import torch
    from crucible_models import load_tokenizer, resolve_model_path
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(base)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stored = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    target = (
        getattr(torch, dtype) if dtype else (stored if isinstance(stored, torch.dtype) else torch.float32)
    )
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged = merged.to(target)
    tokenizer = load_tokenizer(base)
    with output_dir(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out
