"""Random-weight checkpoints with the exact shapes of real models, built where they run (no weights
travel): the published config (`SHAPES`) with seeded random weights, saved to `OUT/<name>`, and the
built-in tokenizer padded to the model's vocabulary with placeholder tokens no text encodes to.
Random weights write garbage: measure with `ignore_eos` and fixed lengths, never learning.

    python bench/model_shapes.py qwen2.5-coder-1.5b qwen2.5-coder-7b --out /root/shapes [--tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

# From Qwen/Qwen2.5-Coder-1.5B-Instruct's and -7B-Instruct's config.json (the base models share them).
QWEN2 = {"model_type": "qwen2", "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu"}
QWEN2 |= {"max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": None}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-coder-1.5b": QWEN2 | {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                                   "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                                   "tie_word_embeddings": True, "max_window_layers": 21},
    "qwen2.5-coder-7b": QWEN2 | {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                 "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                                 "tie_word_embeddings": False, "max_window_layers": 28},
}  # fmt: skip
PLACEHOLDER = "<|pad_{:06d}|>"


def config_for(name: str, tokenizer: Any, tiny: bool = False) -> Any:
    """The transformers config of shape `name`, with the tokenizer's special token ids."""
    from transformers import AutoConfig

    values = dict(SHAPES[name])
    model_type = values.pop("model_type")
    if tiny:
        values["num_hidden_layers"] = 2
    values |= {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    return AutoConfig.for_model(model_type, **values)


def pad_tokenizer(folder: Path, vocab_size: int) -> int:
    """Give the saved fast tokenizer in `folder` entries up to `vocab_size` ids; how many it added.

    The entries go into the BPE vocabulary with no merge that produces them: decoding knows them,
    encoding never yields them (ByteLevel: `<`, `|`, letters and digits map to themselves)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    start = max(taken) + 1
    for i in range(start, vocab_size):
        vocab[PLACEHOLDER.format(i)] = i
    path.write_text(json.dumps(data, ensure_ascii=False))
    return max(0, vocab_size - start)


def build(name: str, out: Path, device: str, dtype: str, seed: int, tiny: bool) -> dict[str, Any]:
    """Build, save and check one shape; returns what was built."""
    import crucible_models
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = crucible_models.load_tokenizer()
    config = config_for(name, tokenizer, tiny)
    target = out / (f"{name}-tiny" if tiny else name)
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    params = sum(p.numel() for p in model.parameters())
    model.generation_config.update(
        **{k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    )
    model.save_pretrained(target)
    del model
    tokenizer.save_pretrained(target)
    added = pad_tokenizer(target, config.vocab_size)
    saved = AutoTokenizer.from_pretrained(target)
    text = "def add(a, b):\n    return a + b\n"
    assert len(saved) == config.vocab_size, (len(saved), config.vocab_size)
    assert max(saved(text * 20).input_ids) < config.vocab_size - added, "text encoded to a placeholder"
    assert saved.decode([config.vocab_size - 1]) == PLACEHOLDER.format(config.vocab_size - 1)
    built = {"name": name, "path": str(target), "parameters": params, "vocab_size": config.vocab_size}
    return built | {
        "placeholder_tokens": added,
        "dtype": dtype,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--device", default=None, help="where weights are initialised (default: cuda if present)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="2 layers: check the script cheaply")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    built = [build(n, args.out, device, args.dtype, args.seed, args.tiny) for n in args.names]
    json.dump(built, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
