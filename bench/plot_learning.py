"""Plot the learning runs' per-step curves (reward, zero-signal groups, completion length) side by side.

Usage: python bench/plot_learning.py RUN.json [RUN.json ...] --out curves.png
Each RUN.json is what `bench/grpo_race.py --json` writes (`bash bench/gpu.sh learn ...`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS = [
    ("reward_mean", "mean reward (fraction of tests)"),
    ("zero_signal_fraction", "groups with no reward variance"),
    ("completion_tokens_mean", "completion tokens (mean)"),
]


def smooth(values: list[float], window: int = 10) -> list[float]:
    """Trailing mean over `window` steps (single steps are too noisy to read)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for path in args.runs:
        run = json.loads(path.read_text())
        rows = run["rows"]
        samples, seen = [], 0
        for r in rows:
            seen += r.get("samples", 0)
            samples.append(seen)
        ev = run.get("eval") or {}
        label = run["method"].upper()
        if run.get("filter", "none") != "none":
            label += f", {run['filter']} filter"
        if ev.get("before") and ev.get("after"):
            label += f" (pass@1 {ev['before']['greedy_pass@1']:.1%} → {ev['after']['greedy_pass@1']:.1%})"
        for ax, (key, title) in zip(axes, PANELS, strict=True):
            ax.plot(samples, smooth([float(r.get(key) or 0.0) for r in rows]), label=label)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("samples generated")
    axes[0].legend(fontsize=8)
    fig.suptitle("Learning runs on MBPP train (10-step trailing mean)", fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
