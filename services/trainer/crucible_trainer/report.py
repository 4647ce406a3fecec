"""Learning-curve plot from a job's metrics.jsonl: one panel per training metric present, plus
the evaluations (before, every N steps, after) as a time series."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = [
    ("reward_mean", "reward (mean)"),
    ("pass_rate", "pass rate"),
    ("zero_signal_fraction", "zero-signal groups"),
    ("c2_rescue_rate", "c2 rescue rate"),
    ("filter/extra_draw_fraction", "extra groups drawn"),
    ("eval/greedy_pass@1", "eval: greedy pass@1"),
]


def learning_curve(metrics_path: Path, out: Path) -> Path | None:
    if not metrics_path.exists():
        return None
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(k, label) for k, label in CURVES if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
    for ax, (key, label) in zip(axes[0], present, strict=True):
        xs = [r["step"] for r in rows if key in r]
        ys = [r[key] for r in rows if key in r]
        ax.plot(xs, ys, marker="o", ms=3)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
