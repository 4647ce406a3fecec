"""Decode-step attention at SmolLM2-135M's shapes (docs/benchmarks.md, "Decode attention on the CPU"): the
keys and values expanded per query head (transformers' SDPA path under a mask) against the packed
grouping of `crucible_generator/attention.py`, over the continuous batch's windows; milliseconds per
decode step (all layers' attention) and the ratio packed / expanded.

    python bench/decode_attention.py [--json out.json]
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from crucible_generator.attention import packed_gqa_sdpa
from transformers.integrations.sdpa_attention import repeat_kv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30
WINDOWS = [(64, 256), (128, 256), (256, 512), (256, 768)]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE, REPEATS = (torch.bfloat16, 50) if DEVICE.type == "cuda" else (torch.float32, 3)  # steps timed


def expanded(module, query, key, value, mask, scaling=None):
    """transformers' SDPA path: the key/value heads repeated for every query head."""
    groups = module.num_key_value_groups
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2), None


def ms_per_step(attend, rows: int, slots: int) -> float:
    """Milliseconds of one decode step's attention over every layer, after two warm-up steps."""
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS)
    query = torch.randn(rows, HEADS, 1, DIM, device=DEVICE, dtype=DTYPE)
    caches = [torch.randn(2, rows, KV_HEADS, slots, DIM, device=DEVICE, dtype=DTYPE) for _ in range(LAYERS)]
    mask = torch.zeros(rows, 1, 1, slots, device=DEVICE, dtype=DTYPE)
    mask[:, :, :, slots // 2 :] = torch.finfo(DTYPE).min  # half the window beyond the rows' ends
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else lambda: None
    for step in range(REPEATS + 2):
        if step == 2:
            sync()
            started = time.perf_counter()
        for k, v in caches:
            attend(module, query, k, v, mask, scaling=DIM**-0.5)
    sync()
    return 1000 * (time.perf_counter() - started) / REPEATS


def main() -> None:
    args = common.options(common.argument_parser(__doc__), json=None).parse_args()
    rows = []
    for batch, slots in WINDOWS:
        ms = {
            name: ms_per_step(attend, batch, slots)
            for name, attend in (("expanded", expanded), ("packed", packed_gqa_sdpa))
        }
        rows.append({"rows": batch, "slots": slots, **ms, "ratio": ms["packed"] / ms["expanded"]})
        print(rows[-1], flush=True)
    print(f"\n{DEVICE} ({common.card()}), {DTYPE}")
    head = ["rows x slots", "expanded ms/step", "packed ms/step", "packed / expanded"]
    cells = [
        [f"{r['rows']} x {r['slots']}", *(f"{r[k]:.2f}" for k in ("expanded", "packed", "ratio"))]
        for r in rows
    ]
    print(common.md_table(head, cells, " :::"))
    if args.json:
        common.dump(Path(args.json), {"device": str(DEVICE), "dtype": str(DTYPE), "rows": rows})


if __name__ == "__main__":
    main()
