"""Decode-step attention at SmolLM2-135M's shapes (docs/benchmarks.md, "Decode attention on the CPU"): the
keys and values expanded per query head (transformers' SDPA path under a mask) against the packed
grouping of `crucible_generator/attention.py`, over the continuous batch's windows; milliseconds per
decode step (all layers' attention) and the ratio packed / expanded.

    python bench/decode_attention.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "generator"))

from crucible_generator.attention import packed_gqa_sdpa  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30
WINDOWS = [(64, 256), (128, 256), (256, 512), (256, 768)]


def expanded(module, query, key, value, mask, scaling=None):
    """transformers' SDPA path: the key/value heads repeated for every query head."""
    groups = module.num_key_value_groups
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2), None


def step(attend, query, keys, values, mask) -> None:
    """One decode step's attention over every layer."""
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS)
    for k, v in zip(keys, values, strict=True):
        attend(module, query, k, v, mask, scaling=DIM**-0.5)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of `fn` after two warm-up calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for _ in range(2):
        fn()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=0, help="steps timed (0: 50 on CUDA, 3 on a CPU)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    repeats = args.repeats or (50 if device.type == "cuda" else 3)
    rows = []
    for batch, slots in WINDOWS:
        query = torch.randn(batch, HEADS, 1, DIM, device=device, dtype=dtype)
        keys = [torch.randn(batch, KV_HEADS, slots, DIM, device=device, dtype=dtype) for _ in range(LAYERS)]
        values = [torch.randn(batch, KV_HEADS, slots, DIM, device=device, dtype=dtype) for _ in range(LAYERS)]
        mask = torch.zeros(batch, 1, 1, slots, device=device, dtype=dtype)
        mask[:, :, :, slots // 2 :] = torch.finfo(dtype).min  # half the window beyond the rows' ends

        inputs = (query, keys, values, mask)
        ms = {
            name: 1000 * timed(lambda a=attend, x=inputs: step(a, *x), device, repeats)
            for name, attend in (("expanded", expanded), ("packed", packed_gqa_sdpa))
        }
        rows.append({"rows": batch, "slots": slots, **ms, "ratio": ms["packed"] / ms["expanded"]})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), {dtype}")
    print("| rows x slots | expanded ms/step | packed ms/step | packed / expanded |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rows']} x {r['slots']} | {r['expanded']:.2f} | {r['packed']:.2f} | {r['ratio']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "dtype": str(dtype), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
