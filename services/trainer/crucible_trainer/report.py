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


def samples_per_step(spec: dict) -> int:
    """Most samples a train job draws per step (its sample budget), from its spec.

    >>> samples_per_step({"method": {"name": "grpo", "group_size": 8}, "optim": {"problems_per_step": 8}})
    64
    >>> samples_per_step({"method": {"name": "srrl", "budget": 10}, "optim": {"problems_per_step": 8}})
    80
    """
    from crucible_shared.jobs import TrainJob

    job = TrainJob.model_validate(spec)
    method = job.method
    per_problem = {"grpo": "group_size", "srrl": "budget", "reinforce": "samples", "ppo": "samples"}[
        method.name
    ]
    return getattr(method, per_problem) * job.optim.problems_per_step


def compare_runs(runs: list[dict], out: Path) -> dict[str, Path]:
    """One report for runs that differ in their method: `comparison.md` (before/after of every
    run, final reward, c2 rescue rate where it applies) and `curves.png` (reward and evaluations
    over the steps, every run on one plot). Each run: `label`, `spec`, `summary`, `metrics` (rows
    of its metrics.jsonl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Method comparison",
        "",
        "| run | method | samples / step | before pass@1 | after pass@1 | change | last reward | c2 rescue |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.1f}%"

    for run in runs:
        evals = (run["summary"] or {}).get("eval", {})
        before = evals.get("before", {}).get("greedy_pass@1")
        after = evals.get("after", {}).get("greedy_pass@1")
        steps = [r for r in run["metrics"] if "reward_mean" in r]
        rescue = [r["c2_rescue_rate"] for r in steps if "c2_rescue_rate" in r]
        cells = [
            run["label"],
            run["spec"]["method"]["name"],
            str(samples_per_step(run["spec"])),
            pct(before),
            pct(after),
            "-" if before is None or after is None else f"{(after - before) * 100:+.1f}",
            f"{steps[-1]['reward_mean']:.3f}" if steps else "-",
            pct(sum(rescue) / len(rescue)) if rescue else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![curves](curves.png)"]
    fig, (rewards, evals_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run in runs:
        steps = [r for r in run["metrics"] if "reward_mean" in r]
        rewards.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label=run["label"])
        points = [r for r in run["metrics"] if "eval/greedy_pass@1" in r]
        evals_ax.plot(
            [r["step"] for r in points],
            [r["eval/greedy_pass@1"] * 100 for r in points],
            marker="o",
            label=run["label"],
        )
    rewards.set_title("reward (mean)")
    evals_ax.set_title("greedy pass@1 (%)")
    for ax in (rewards, evals_ax):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    (out / "comparison.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "metrics"} for r in runs], indent=1, default=str)
    )
    return {"markdown": out / "comparison.md", "plot": out / "curves.png"}
