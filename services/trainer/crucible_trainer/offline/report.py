"""`report.md` of a pipeline run: what ran (and what was skipped) with its time, the datasets
of each round, the before/after evaluation and the candidate analysis, with links to the files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def render(summary: dict[str, Any], run_dir: Path) -> str:
    lines = [f"# Pipeline {summary.get('job_id', '')}", "", f"Status: {summary.get('status', '?')}", ""]
    lines += ["## Stages", "", "| stage | status | seconds |", "|---|---|---|"]
    for key, info in summary.get("stages", {}).items():
        lines.append(f"| {key} | {info['status']} | {info.get('seconds', 0):.1f} |")
    rounds = summary.get("rounds") or {}
    if rounds:
        lines += [
            "",
            "## Datasets",
            "",
            "| round | problems | candidates | passing | nbest | pairs |",
            "|---|---|---|---|---|---|",
        ]
        for name, c in rounds.items():
            lines.append(
                f"| {name} | {c['problems']} | {c['candidates']} | {c['passing']} "
                f"({c['problems_with_pass']} problems) | {c['nbest']} | {c['pairs']} |"
            )
    evals = summary.get("eval") or {}
    if evals:
        lines += ["", "## Evaluation", "", "| | greedy pass@1 | problems |", "|---|---|---|"]
        for label, e in evals.items():
            rate = e.get("greedy_pass@1")
            shown = "-" if rate is None else f"{100 * rate:.1f}%"
            lines.append(f"| {label} | {shown} | {e.get('problems', '-')} |")
        if (run_dir / "eval" / "before_after" / "comparison.md").exists():
            lines += [
                "",
                "Before/after, per problem: [eval/before_after/comparison.md](eval/before_after/comparison.md)",
            ]
    analysis = run_dir / "analysis" / "analysis.md"
    if analysis.exists():
        body = analysis.read_text().replace("](analysis.png)", "](analysis/analysis.png)")
        lines += ["", body.replace("# Candidate analysis", "## Candidate analysis", 1)]
    return "\n".join(lines).rstrip() + "\n"


def round_counts(manifest: Path) -> dict[str, Any] | None:
    return json.loads(manifest.read_text())["counts"] if manifest.exists() else None
