"""Learning-curve plot from a job's metrics.jsonl: one panel per training metric present (a game
job's per-role and per-opponent metrics one line per role or opponent), plus the evaluations
(before, every N steps, after) as a time series."""

from __future__ import annotations

import json
import re
from pathlib import Path

from crucible_shared import jsonl

CURVES = [
    ("reward_mean", "reward (mean)"),
    ("pass_rate", "pass rate"),
    ("zero_signal_fraction", "zero-signal groups"),
    ("c2_rescue_rate", "c2 rescue rate"),
    ("filter/extra_draw_fraction", "extra groups drawn"),
    # Game jobs (SPIRAL): `*` is one path segment, one line per match (a role, an opponent).
    ("role/*/return_mean", "return per role"),
    ("role/*/win_rate", "win rate per role"),
    ("role/*/illegal_rate", "illegal moves per role"),
    ("role/*/baseline", "baseline per role (RAE)"),
    ("rae/advantage_sq_*", "mean squared advantage"),
    ("game/predictor_accuracy", "predictor accuracy"),
    ("game/writer_invalid_rate", "writer invalid rate"),
    ("arena/*/win_rate", "win rate vs fixed opponents"),
    ("eval/greedy_pass@1", "eval: greedy pass@1"),
]
COLUMNS = 6


def _series(rows: list[dict], pattern: str) -> dict[str, list[tuple[float, float]]]:
    """(step, value) points of every metric `pattern` names, by what its `*` matched (or the key).

    >>> _series([{"step": 1, "role/x/win_rate": 0.5, "role/o/win_rate": 0.25, "arena/b/x/win_rate": 1}],
    ...         "role/*/win_rate")
    {'x': [(1, 0.5)], 'o': [(1, 0.25)]}
    """
    match = re.compile("^" + re.escape(pattern).replace(r"\*", "([^/]+)") + "$")
    out: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        for key, value in row.items():
            found = match.match(key)
            if found and isinstance(value, int | float):
                out.setdefault(found.group(1) if found.groups() else key, []).append((row["step"], value))
    return out


def learning_curve(metrics_path: Path, out: Path) -> Path | None:
    if not metrics_path.exists():
        return None
    rows = [r for r in jsonl.rows(metrics_path.read_text()) if "step" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(pattern, label, series) for pattern, label in CURVES if (series := _series(rows, pattern))]
    if not present:
        return None
    cols = min(len(present), COLUMNS)
    nrows = -(-len(present) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, (pattern, label, series) in zip(axes.flat, present, strict=False):
        for name, points in series.items():
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", ms=3, label=name)
        if "*" in pattern:
            ax.legend(fontsize=7)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present) :]:
        ax.set_visible(False)
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
    >>> samples_per_step({"method": {"name": "spiral", "games_per_step": 16}})  # a game job: its games
    16
    """
    from crucible_shared.jobs import TrainJob

    job = TrainJob.model_validate(spec)
    return job.method.samples_per_step(job.optim.problems_per_step)  # a fact of the method's config class


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
        evals = (run["summary"] or {}).get("eval") or {}  # a typed summary sends eval: null
        before = (evals.get("before") or {}).get("greedy_pass@1")
        after = (evals.get("after") or {}).get("greedy_pass@1")
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
