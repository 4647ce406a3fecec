"""Random-weight checkpoints with the exact shapes of real models, built where they run (no weights
travel): the published config (`SHAPES`) with seeded random weights, saved to `OUT/<name>`, and the
built-in tokenizer (or, on a machine that has only Qwen2.5-Coder-1.5B-Instruct installed, Qwen's own)
padded to the model's vocabulary with placeholder tokens no text encodes to.
Random weights write garbage: measure with `ignore_eos` and fixed lengths, never learning.
`local_model` gives the benchmarks theirs: such a shape, or a tiny Qwen2 that checks a script on a CPU.

    python bench/model_shapes.py qwen2.5-coder-1.5b qwen2.5-coder-7b --out /root/shapes
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

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
TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2}
PLACEHOLDER = "<|pad_{:06d}|>"
QWEN_INSTALLED = "qwen2.5-coder-1.5b-instruct"


def shape_tokenizer() -> Any:
    """The built-in model's tokenizer; where it is not installed (a GPU lease that carried only
    Qwen2.5-Coder-1.5B-Instruct's parts), the installed Qwen's, which every Qwen2.5 size shares."""
    import crucible_models

    try:
        return crucible_models.load_tokenizer()
    except FileNotFoundError:
        return crucible_models.load_tokenizer(QWEN_INSTALLED)


def config_for(values: dict[str, Any], tokenizer: Any) -> Any:
    """The transformers config of `values` (`model_type` among them) with the tokenizer's special ids."""
    from transformers import AutoConfig

    values = dict(values)
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    return AutoConfig.for_model(values.pop("model_type"), **values, **ids)


def pad_tokenizer(folder: Path, vocab_size: int) -> int:
    """Give the saved fast tokenizer in `folder` entries up to `vocab_size` ids; how many it added.

    The entries go into the BPE vocabulary with no merge that produces them: decoding knows them,
    encoding never yields them (ByteLevel: `<`, `|`, letters and digits map to themselves)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    start = max({*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))}) + 1
    vocab |= {PLACEHOLDER.format(i): i for i in range(start, vocab_size)}
    path.write_text(json.dumps(data, ensure_ascii=False))
    return max(0, vocab_size - start)


def build(name: str, out: Path) -> dict[str, Any]:
    """Build (bf16, seed 0, on a GPU if any), save and check one shape."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = shape_tokenizer()
    config, target = config_for(SHAPES[name], tokenizer), out / name
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    ids = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    model.generation_config.update(**ids)
    model.save_pretrained(target)
    del model
    tokenizer.save_pretrained(target)
    added = pad_tokenizer(target, config.vocab_size)
    saved = AutoTokenizer.from_pretrained(target)
    assert len(saved) == config.vocab_size, (len(saved), config.vocab_size)
    text = "def add(a, b):\n    return a + b\n" * 20
    assert max(saved(text).input_ids) < config.vocab_size - added, "text encoded to a placeholder"
    assert saved.decode([config.vocab_size - 1]) == PLACEHOLDER.format(config.vocab_size - 1)
    built = {"name": name, "path": str(target), "parameters": params, "vocab_size": config.vocab_size}
    seconds = round(time.perf_counter() - started, 1)
    return built | {"placeholder_tokens": added, "dtype": "bfloat16", "seconds": seconds}


def tiny_model(out: Path) -> str:
    """A 2-layer Qwen2 of hidden size 64 with the shapes' tokenizer (random weights, CPU), at `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = shape_tokenizer()
    torch.manual_seed(0)
    config = config_for(TINY | {"vocab_size": len(tokenizer)}, tokenizer)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def local_model(shape: str | None, tmp: Path) -> str:
    """The checkpoint of `shape` (else the tiny model) in `tmp`, a folder the generators may read."""
    model = build(shape, tmp)["path"] if shape else tiny_model(tmp / "tiny")
    roots = [str(tmp), str(common.ROOT), *filter(None, os.environ.get("CRUCIBLE_MODEL_ROOTS", "").split(","))]
    os.environ["CRUCIBLE_MODEL_ROOTS"] = ",".join(roots)
    return model


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("names", nargs="+", choices=sorted(SHAPES))
    args = common.options(parser, out=Path).parse_args()
    print(json.dumps([build(name, args.out) for name in args.names], indent=2))


if __name__ == "__main__":
    main()
