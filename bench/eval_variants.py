"""Where an evaluation's generation time goes: the same greedy MBPP-test evaluation through servers
given by URL and through Crucible generators started here with different settings, one after the
other, with the generator's own counters read before and after each run (decode steps, rows per
step, admissions into running batches, prompt and generated tokens).

Usage (GPU machine; `bash bench/gpu.sh eval-variants N` runs the standard set):
    python bench/eval_variants.py --limit 500 --server vllm=http://127.0.0.1:8101 \
        --variant default --variant rows128=MAX_BATCH_SIZE=128 --variant join2ms=JOIN_WAIT_MS=2 \
        --json out.json
A variant is NAME[=KEY=VALUE[,KEY=VALUE...]], each KEY a generator setting without its
`CRUCIBLE_GENERATOR_` prefix. Prints one table row per run; `--json` keeps every figure, `--out DIR`
each run's report (`bash bench/gpu.sh eval-servers N`: the two servers alone).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COUNTERS = {
    "steps": "crucible_generator_batch_size_count",
    "rows_sum": "crucible_generator_batch_size_sum",
    "generated": "crucible_generator_generation_tokens_total",
    "prompt": "crucible_generator_prompt_tokens_total",
    "joined": "crucible_generator_joined_sequences_total",
    "captures": "crucible_generator_graph_captures_total",
}


def scrape(url: str) -> dict[str, float] | None:
    """The generator's counters (None for a server without Crucible's metrics)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out = {}
    for key, name in COUNTERS.items():
        match = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        if match:
            out[key] = float(match.group(1))
    return out or None


def evaluate(name: str, url: str, sandbox: str, limit: int, work: Path) -> dict[str, Any]:
    before = scrape(url)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "crucible_cli", "eval", "--split", "test", "--limit", str(limit), "--n", "0",
         "--max-tokens", "256", "--concurrency", "256", "--quiet", "--generator", url, "--sandbox", sandbox,
         "--out", str(work / name)],
        check=True,
    )  # fmt: skip
    wall = time.perf_counter() - started
    after = scrape(url)
    report = json.loads((work / name / "report.json").read_text())
    row: dict[str, Any] = {
        "name": name,
        "wall_s": round(wall, 2),
        "generation_s": round(report["timing"]["generation_s"], 2),
        "greedy_pass@1": report["greedy_pass_at_1"],
        "mean_generated_tokens": report["mean_generated_tokens"],
    }
    if before and after:
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
        steps = delta["steps"] or 1.0
        row.update(
            decode_steps=int(delta["steps"]),
            rows_per_step=round(delta["rows_sum"] / steps, 1),
            ms_per_step=round(1000 * report["timing"]["generation_s"] / steps, 2),
            generated_tokens=int(delta["generated"]),
            prompt_tokens=int(delta["prompt"]),
            joined=int(delta["joined"]),
            captures=int(delta["captures"]),
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--server", action="append", default=[], help="NAME=URL of a running server")
    parser.add_argument("--variant", action="append", default=[], help="NAME[=KEY=VALUE,...]")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out", type=Path, help="keep each run's report here (NAME/report.json, ...)")
    args = parser.parse_args()

    from crucible_cli.spawn import start

    work = args.out or Path(tempfile.mkdtemp(prefix="crucible-eval-variants-"))
    work.mkdir(parents=True, exist_ok=True)
    sandbox = start("crucible_sandbox", {}, "CRUCIBLE_SANDBOX_PORT", log=work / "sandbox.log", timeout=300)
    rows = []
    try:
        for spec in args.server:
            name, url = spec.split("=", 1)
            rows.append(evaluate(name, url.rstrip("/"), sandbox.url, args.limit, work))
            print(json.dumps(rows[-1]), flush=True)
        for spec in args.variant:
            name, _, settings = spec.partition("=")
            env = {"CRUCIBLE_GENERATOR_LOG_LEVEL": "warning"}
            for pair in filter(None, settings.split(",")):
                key, value = pair.split("=", 1)
                env[f"CRUCIBLE_GENERATOR_{key.upper()}"] = value
            generator = start(
                "crucible_generator",
                env,
                "CRUCIBLE_GENERATOR_PORT",
                log=work / f"generator-{name}.log",
                timeout=600,
            )
            try:
                rows.append(
                    {**evaluate(name, generator.url, sandbox.url, args.limit, work), "settings": settings}
                )
            finally:
                generator.stop()
            print(json.dumps(rows[-1]), flush=True)
    finally:
        sandbox.stop()
    keys = ["name", "wall_s", "generation_s", "greedy_pass@1", "decode_steps", "rows_per_step", "ms_per_step",
            "generated_tokens", "joined"]  # fmt: skip
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "-")) for k in keys) + " |")
    if args.json:
        args.json.write_text(json.dumps({"limit": args.limit, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
