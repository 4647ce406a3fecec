"""Profile the generator's adapter load (the hot-swap cost) in-process: where do the seconds go?

Usage: python bench/profile_adapter_load.py [--device auto] [--loads 6]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--loads", type=int, default=6)
    args = parser.parse_args()

    import crucible_models as models
    from crucible_generator.engine import Engine
    from peft import LoraConfig, get_peft_model

    model, tokenizer = models.load_model(device=args.device)
    work = Path(tempfile.mkdtemp())
    lora = get_peft_model(
        models.load_model(device=args.device)[0], LoraConfig(r=16, target_modules="all-linear")
    )
    lora.save_pretrained(work / "adapter")
    engine = Engine(model, tokenizer, max_loras=4)  # not started: loads run on this thread, profiled

    def load(name: str) -> float:
        started = time.perf_counter()
        engine._attach(name, engine.adapters.reserve(name, str(work / "adapter")).slot, str(work / "adapter"))
        engine.adapters.mark_ready(name)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    load("warm-up")
    profiler = cProfile.Profile()
    profiler.enable()
    times = []
    for i in range(args.loads):
        times.append(load(f"a{i}"))
        if i >= 2:
            engine._detach(f"a{i - 2}")
    profiler.disable()
    print("load seconds:", " ".join(f"{t:.3f}" for t in times), "device:", engine.device, torch.__version__)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(30)
    print(out.getvalue()[:6000])


if __name__ == "__main__":
    main()
