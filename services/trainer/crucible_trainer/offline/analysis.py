"""Stage `analyze`: what the sampled candidates look like (pure functions plus the report files).

Per round: candidate diversity (distinct programs per problem, `normalize.normalize_code`; mean
pairwise similarity of a problem's programs, the Jaccard index of token trigrams, over at most
`MAX_PAIRWISE` candidates per problem), the pass-rate distribution over problems, token
statistics (all, passing and failing candidates; share cut off by max_tokens) and the sandbox
statuses. `write` puts `analysis.json`, `analysis.md` and `analysis.png` in a folder.
"""

from __future__ import annotations

import statistics
from collections import Counter
from itertools import combinations
from pathlib import Path
from typing import Any

from crucible_trainer.offline.normalize import normalize_code, similarity, trigrams

MAX_PAIRWISE = 16  # candidates per problem compared pairwise (120 pairs)
# Pass-rate buckets over problems: none, (0, 25%], (25, 50%], (50, 75%], (75%, 100%), all.
BUCKETS = ("0", "(0,0.25]", "(0.25,0.5]", "(0.5,0.75]", "(0.75,1)", "1")


def bucket(rate: float) -> str:
    """The pass-rate bucket of a problem.

    >>> bucket(0.0), bucket(0.25), bucket(0.6), bucket(1.0)
    ('0', '(0,0.25]', '(0.5,0.75]', '1')
    """
    if rate <= 0:
        return BUCKETS[0]
    if rate >= 1:
        return BUCKETS[5]
    for i, upper in enumerate((0.25, 0.5, 0.75), start=1):
        if rate <= upper:
            return BUCKETS[i]
    return BUCKETS[4]


def analyze_round(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The statistics of one round's annotated candidates."""
    problems: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        problems.setdefault(row["task_id"], []).append(row)
    rates = {tid: sum(r["passed"] for r in group) / len(group) for tid, group in problems.items()}
    distinct = [
        len({normalize_code(r["code"]) for r in group if r["code"].strip()}) for group in problems.values()
    ]
    sims = [s for group in problems.values() if (s := _mean_similarity(group)) is not None]
    tokens = [r.get("tokens") or 0 for r in rows]
    return {
        "problems": len(problems),
        "candidates": len(rows),
        "candidates_per_problem": len(rows) / len(problems) if problems else 0.0,
        "pass_rate": sum(r["passed"] for r in rows) / len(rows) if rows else 0.0,
        "problems_solved": sum(1 for v in rates.values() if v > 0),
        "pass_rate_distribution": {b: sum(1 for v in rates.values() if bucket(v) == b) for b in BUCKETS},
        "distinct_programs_per_problem": _stats(distinct),
        "distinct_passing_per_problem": _stats(
            [len({normalize_code(r["code"]) for r in group if r["passed"]}) for group in problems.values()]
        ),
        "mean_pairwise_similarity": statistics.fmean(sims) if sims else None,
        "tokens": {
            "all": _stats(tokens),
            "passing": _stats([r.get("tokens") or 0 for r in rows if r["passed"]]),
            "failing": _stats([r.get("tokens") or 0 for r in rows if not r["passed"]]),
            "truncated_fraction": (
                sum(1 for r in rows if r.get("finish_reason") == "length") / len(rows) if rows else 0.0
            ),
        },
        "statuses": dict(sorted(Counter(r["status"] for r in rows).items())),
        "per_problem_pass_rate": rates,
    }


def _mean_similarity(group: list[dict[str, Any]]) -> float | None:
    programs = [trigrams(r["code"]) for r in group[:MAX_PAIRWISE] if r["code"].strip()]
    pairs = list(combinations(programs, 2))
    if not pairs:
        return None
    return statistics.fmean(similarity(a, b) for a, b in pairs)


def _stats(values: list[int | float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p90": None, "max": None}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "median": float(statistics.median(ordered)),
        "p90": float(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]),
        "max": float(ordered[-1]),
    }


def render_markdown(analysis: dict[str, Any]) -> str:
    """The analysis as a Markdown section, one column per round."""
    rounds = analysis["rounds"]
    names = list(rounds)
    lines = ["# Candidate analysis", "", "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def row(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(rounds[n]) for n in names) + " |")

    row("problems", lambda r: str(r["problems"]))
    row("candidates", lambda r: str(r["candidates"]))
    row("pass rate", lambda r: _pct(r["pass_rate"]))
    row("problems solved (any pass)", lambda r: str(r["problems_solved"]))
    row("distinct programs / problem", lambda r: _num(r["distinct_programs_per_problem"]["mean"]))
    row("distinct passing / problem", lambda r: _num(r["distinct_passing_per_problem"]["mean"]))
    row("mean pairwise similarity", lambda r: _num(r["mean_pairwise_similarity"]))
    row("tokens: mean / median / p90", lambda r: _tokens(r["tokens"]["all"]))
    row("tokens of passing", lambda r: _tokens(r["tokens"]["passing"]))
    row("tokens of failing", lambda r: _tokens(r["tokens"]["failing"]))
    row("cut off by max_tokens", lambda r: _pct(r["tokens"]["truncated_fraction"]))
    for b in BUCKETS:
        row(f"problems with pass rate {b}", lambda r, b=b: str(r["pass_rate_distribution"][b]))
    row("statuses", lambda r: ", ".join(f"{k} {v}" for k, v in r["statuses"].items()))
    lines += ["", "Similarity: mean Jaccard index of token trigrams over pairs of a problem's programs.", ""]
    lines.append("![pass rates and tokens](analysis.png)")
    return "\n".join(lines) + "\n"


def write(analysis: dict[str, Any], out: Path) -> dict[str, Path]:
    import json

    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "analysis.json", "markdown": out / "analysis.md", "plot": out / "analysis.png"}
    paths["json"].write_text(json.dumps(analysis, indent=1), encoding="utf-8")
    paths["markdown"].write_text(render_markdown(analysis), encoding="utf-8")
    _plot(analysis, paths["plot"])
    return paths


def _plot(analysis: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    rounds = analysis["rounds"]
    width = 0.8 / max(1, len(rounds))
    for i, (name, r) in enumerate(rounds.items()):
        counts = [r["pass_rate_distribution"][b] for b in BUCKETS]
        left.bar([x + i * width for x in range(len(BUCKETS))], counts, width=width, label=name)
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(BUCKETS))], BUCKETS, fontsize=8)
    left.set_title("problems by pass rate")
    left.set_ylabel("problems")
    stats = [(name, r["tokens"]) for name, r in rounds.items()]
    right.bar(range(len(stats)), [s["all"]["mean"] or 0 for _, s in stats], tick_label=[n for n, _ in stats])
    right.set_title("mean tokens per candidate")
    if len(rounds) > 1:
        left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _tokens(stats: dict[str, float | None]) -> str:
    if stats["mean"] is None:
        return "-"
    return f"{stats['mean']:.0f} / {stats['median']:.0f} / {stats['p90']:.0f}"
