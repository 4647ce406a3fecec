"""Report files: JSON (machine-readable), a Markdown summary and PNG plots.

`write_report` writes `report.json`, `report.md` and `pass_at_k.png` (the pass@k curve);
`compare_reports` writes `comparison.md` and `comparison.png` for a before/after pair;
`compare_many` writes `results.md` and `results.png`, one row per report, for any number of
checkpoints or runs.
matplotlib is imported only when a plot is drawn, with its non-interactive Agg canvas.
"""

from __future__ import annotations

from pathlib import Path

from .report import Category, EvalReport, ProblemResult

_CATEGORIES = [c.value for c in Category]


def load_report(path: str | Path) -> EvalReport:
    """An `EvalReport` from its JSON file (or from a folder holding `report.json`)."""
    file = Path(path)
    if file.is_dir():
        file = file / "report.json"
    return EvalReport.model_validate_json(file.read_text(encoding="utf-8"))


def write_report(report: EvalReport, out_dir: str | Path) -> dict[str, Path]:
    """Write `report.json`, `report.md` and `pass_at_k.png` into `out_dir` (created if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "plot": out / "pass_at_k.png"}
    paths["json"].write_text(report.model_dump_json(indent=1), encoding="utf-8")
    paths["markdown"].write_text(render_markdown(report, plot=paths["plot"].name), encoding="utf-8")
    _plot_curve(report, paths["plot"])
    return paths


def compare_reports(
    before: EvalReport | str | Path, after: EvalReport | str | Path, out_dir: str | Path
) -> dict[str, Path]:
    """Write `comparison.md` and `comparison.png` (before vs after) into `out_dir`."""
    before = before if isinstance(before, EvalReport) else load_report(before)
    after = after if isinstance(after, EvalReport) else load_report(after)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "comparison.md", "plot": out / "comparison.png"}
    paths["markdown"].write_text(render_comparison(before, after, plot=paths["plot"].name), encoding="utf-8")
    _plot_comparison(before, after, paths["plot"])
    return paths


def compare_many(
    reports: list[EvalReport | str | Path], out_dir: str | Path, labels: list[str] | None = None
) -> dict[str, Path]:
    """Write `results.md` (one row per report) and `results.png` (greedy pass@1 per report, and
    every pass@k curve) into `out_dir`. Labels default to each report's folder name."""
    loaded = [r if isinstance(r, EvalReport) else load_report(r) for r in reports]
    if labels is None:
        labels = [
            (Path(r).name if Path(r).is_dir() else Path(r).parent.name)
            if not isinstance(r, EvalReport)
            else r.model
            for r in reports
        ]
    if len(labels) != len(loaded):
        raise ValueError(f"{len(labels)} labels for {len(loaded)} reports")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "results.md", "plot": out / "results.png"}
    paths["markdown"].write_text(render_table(loaded, labels, plot=paths["plot"].name), encoding="utf-8")
    _plot_many(loaded, labels, paths["plot"])
    return paths


def render_table(reports: list[EvalReport], labels: list[str], plot: str | None = "results.png") -> str:
    ks = sorted({k for r in reports for k in r.pass_at_k})
    head = ["run", "model", "problems", "greedy pass@1", *[f"pass@{k}" for k in ks], "mean tokens", "dropped"]
    lines = ["# Evaluation results", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in zip(labels, reports, strict=True):
        row = [
            _cell(label),
            _cell(r.model),
            str(r.num_problems),
            _pct(r.greedy_pass_at_1),
            *[_pct(r.pass_at_k.get(k)) for k in ks],
            "-" if r.mean_generated_tokens is None else f"{r.mean_generated_tokens:.1f}",
            str(r.dropped),
        ]
        lines.append("| " + " | ".join(row) + " |")
    if len({r.fingerprint for r in reports}) < len(reports):
        lines += ["", "Some reports are identical (same fingerprint)."]
    if plot:
        lines += ["", f"![results]({plot})"]
    return "\n".join(lines) + "\n"


# --- Markdown ------------------------------------------------------------------------------------


def title(report: EvalReport) -> str:
    data = (
        report.data.describe() if report.data else ", ".join(f"{k} ({v})" for k, v in report.datasets.items())
    )
    return f"{report.model} on {data}"


def render_markdown(report: EvalReport, plot: str | None = "pass_at_k.png") -> str:
    """The report as a Markdown page: setup, headline metrics, failures, time and a per-problem table."""
    c = report.config
    sampling = f"n={c.n} at T={c.temperature}, top_p={c.top_p}" if c.n else "none"
    lines = [
        f"# Evaluation: {title(report)}",
        "",
        "| setting | value |",
        "|---|---|",
        f"| model | `{report.model}` ({report.generator.get('root') or 'n/a'}) |",
        f"| problems | {report.num_problems} ({', '.join(f'{k}: {v}' for k, v in report.datasets.items())}) |",
        f"| samples | {sampling}; greedy: {'yes' if c.greedy else 'no'} |",
        f"| prompts | {'chat' if c.chat else 'completion'}, max_tokens={c.max_tokens}, seed={c.seed} |",
        f"| started | {report.started_at} |",
        f"| fingerprint | `{report.fingerprint[:16]}` |",
        "",
        "## Results",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    if report.greedy_pass_at_1 is not None:
        lines.append(f"| greedy pass@1 | {_pct(report.greedy_pass_at_1)} |")
    lines += [f"| pass@{k} (T={c.temperature}) | {_pct(v)} |" for k, v in report.pass_at_k.items()]
    per_mode = ", ".join(f"{m} {v:.1f}" for m, v in report.mean_tokens.items())
    if report.mean_generated_tokens is not None:
        lines.append(f"| mean generated tokens | {report.mean_generated_tokens:.1f} ({per_mode}) |")
    lines += [
        f"| cut off by max_tokens | {_pct(report.truncated_fraction)} |",
        f"| dropped (sandbox errors) | {report.dropped} |",
        f"| greedy answers that ignore their input | {_count(report.hard_coded_answers)} |",
        "",
    ]
    if plot:
        lines += [f"![pass@k]({plot})", ""]
    lines += _failure_table(report)
    t = report.timing
    lines += [
        "## Time",
        "",
        "| | seconds | share of wall time |",
        "|---|---:|---:|",
        f"| wall | {t.wall_s:.1f} | 100% |",
        f"| generation busy | {t.generation_s:.1f} | {_share(t.generation_s, t.wall_s)} |",
        f"| execution busy | {t.execution_s:.1f} | {_share(t.execution_s, t.wall_s)} |",
        f"| execution hidden behind generation | {t.overlap_s:.1f} | {_share(t.overlap_s, t.wall_s)} |",
        f"| execution not hidden | {t.execution_exposed_s:.1f} | {_share(t.execution_exposed_s, t.wall_s)} |",
        "",
        f"{_pct(t.execution_hidden)} of the execution time overlapped generation.",
        "",
        "## Per problem",
        "",
        "| task | greedy | passed / n | first failure |",
        "|---|:-:|:-:|---|",
    ]
    lines += [_problem_row(p) for p in report.problems]
    lines += ["", "## Versions", ""]
    lines += [f"- {k}: {v}" for k, v in report.versions.items()]
    lines.append(f"- generator: {report.generator.get('url', '')}; sandbox: {report.sandbox.get('url', '')}")
    return "\n".join(lines) + "\n"


def render_comparison(before: EvalReport, after: EvalReport, plot: str | None = "comparison.png") -> str:
    """Before vs after as Markdown: headline metrics with deltas, failures, and per-problem changes."""
    lines = [
        "# Before / after",
        "",
        f"- before: {title(before)} (fingerprint `{before.fingerprint[:12]}`)",
        f"- after: {title(after)} (fingerprint `{after.fingerprint[:12]}`)",
        "",
        "| metric | before | after | change |",
        "|---|---:|---:|---:|",
    ]
    for name, b, a in _headline_pairs(before, after):
        delta = f"{(a - b) * 100:+.1f} pts" if a is not None and b is not None else ""
        lines.append(f"| {name} | {_pct(b)} | {_pct(a)} | {delta} |")
    tb, ta = before.mean_generated_tokens, after.mean_generated_tokens
    if tb is not None and ta is not None:
        lines.append(f"| mean generated tokens | {tb:.1f} | {ta:.1f} | {ta - tb:+.1f} |")
    lines += ["", "| failure category | before | after |", "|---|---:|---:|"]
    for cat in _CATEGORIES:
        b, a = _total_category(before, cat), _total_category(after, cat)
        if a or b:
            lines.append(f"| {cat} | {b} | {a} |")
    if plot:
        lines += ["", f"![before/after]({plot})"]
    lines += ["", *_problem_changes(before, after)]
    return "\n".join(lines) + "\n"


def _failure_table(report: EvalReport) -> list[str]:
    modes = list(report.failures)
    if not modes:
        return []
    lines = [
        "## Failure categories",
        "",
        "| category | " + " | ".join(modes) + " |",
        "|---|" + "---:|" * len(modes),
    ]
    for cat in _CATEGORIES:
        counts = [report.failures[m].get(cat, 0) for m in modes]
        if any(counts):
            lines.append(f"| {cat} | " + " | ".join(map(str, counts)) + " |")
    return [*lines, ""]


def _problem_row(p: ProblemResult) -> str:
    greedy = "—" if p.greedy_passed is None else ("✓" if p.greedy_passed else "✗")
    failed = [s for s in ([p.greedy] if p.greedy else []) + p.samples if not s.passed]
    first = failed[0].message or failed[0].category.value if failed else ""
    n = f"{p.correct} / {p.n}" if p.samples else ""
    return f"| {p.task_id} | {greedy} | {n} | {_cell(first)} |"


def _problem_changes(before: EvalReport, after: EvalReport) -> list[str]:
    old = {p.task_id: p for p in before.problems}
    common = [p for p in after.problems if p.task_id in old]
    lines = [f"## Per problem ({len(common)} in both reports)", ""]
    if len(common) != len(after.problems) or len(common) != len(before.problems):
        lines += [
            f"The reports cover different problems ({len(before.problems)} before, {len(after.problems)} after); "
            "the headline numbers above are each over its own problems.",
            "",
        ]
    fixed = [p.task_id for p in common if p.greedy_passed and old[p.task_id].greedy_passed is False]
    broken = [p.task_id for p in common if p.greedy_passed is False and old[p.task_id].greedy_passed]
    lines.append(f"- greedy answer fixed ({len(fixed)}): {', '.join(fixed) or 'none'}")
    lines.append(f"- greedy answer broken ({len(broken)}): {', '.join(broken) or 'none'}")
    moved = [(p.task_id, old[p.task_id], p) for p in common if p.samples and old[p.task_id].samples]
    changed = [(t, b, a) for t, b, a in moved if (b.correct, b.n) != (a.correct, a.n)]
    if changed:
        lines += ["", "| task | passed / n before | after |", "|---|:-:|:-:|"]
        lines += [f"| {t} | {b.correct} / {b.n} | {a.correct} / {a.n} |" for t, b, a in changed]
    return lines


def _headline_pairs(before: EvalReport, after: EvalReport) -> list[tuple[str, float | None, float | None]]:
    pairs = [("greedy pass@1", before.greedy_pass_at_1, after.greedy_pass_at_1)]
    for k in sorted(set(before.pass_at_k) | set(after.pass_at_k)):
        pairs.append((f"pass@{k}", before.pass_at_k.get(k), after.pass_at_k.get(k)))
    return [p for p in pairs if p[1] is not None or p[2] is not None]


def _total_category(report: EvalReport, category: str) -> int:
    return sum(counts.get(category, 0) for counts in report.failures.values())


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def _share(part: float, whole: float) -> str:
    return f"{part / whole * 100:.0f}%" if whole > 0 else "—"


def _cell(text: str, limit: int = 100) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- plots ---------------------------------------------------------------------------------------


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _plot_curve(report: EvalReport, path: Path) -> None:
    fig = _figure(6, 4)
    ax = fig.add_subplot()
    _draw_curve(ax, report, label=None)
    ax.set_ylim(bottom=0)
    ax.set_title(f"pass@k: {title(report)}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path)


def _draw_curve(ax, report: EvalReport, label: str | None) -> None:
    prefix = f"{label}: " if label else ""
    curve = [v * 100 for v in report.pass_at_k_curve]
    if curve:
        ks = list(range(1, len(curve) + 1))
        (line,) = ax.plot(ks, curve, marker="o", label=f"{prefix}pass@k (T={report.config.temperature})")
        color = line.get_color()
    else:
        color = None
    if report.greedy_pass_at_1 is not None:
        ax.scatter(
            [1],
            [report.greedy_pass_at_1 * 100],
            marker="*",
            s=140,
            color=color,
            zorder=3,
            edgecolors="black",
            label=f"{prefix}greedy pass@1",
        )
    if len(curve) > 1:
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            range(1, len(curve) + 1)
            if len(curve) <= 10
            else [1, 2, 4, 8, 16, 32, 64, 128][: len(curve).bit_length()]
        )
        ax.get_xaxis().set_major_formatter(_int_formatter())
    ax.set_xlabel("k")
    ax.set_ylabel("% of problems solved")
    ax.grid(alpha=0.3)


def _int_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _pos: f"{x:g}")


def _plot_comparison(before: EvalReport, after: EvalReport, path: Path) -> None:
    fig = _figure(11, 4)
    bars, curves = fig.subplots(1, 2)
    pairs = _headline_pairs(before, after)
    xs = range(len(pairs))
    width = 0.38
    for offset, label, values in (
        (-width / 2, "before", [(b or 0) * 100 for _, b, _ in pairs]),
        (width / 2, "after", [(a or 0) * 100 for _, _, a in pairs]),
    ):
        drawn = bars.bar([x + offset for x in xs], values, width, label=label)
        bars.bar_label(drawn, fmt="%.1f", fontsize=7)
    bars.set_xticks(list(xs), [name for name, _, _ in pairs])
    bars.set_ylabel("% of problems solved")
    bars.set_title("headline metrics", fontsize=9)
    bars.legend(fontsize=8)
    bars.grid(axis="y", alpha=0.3)
    _draw_curve(curves, before, "before")
    _draw_curve(curves, after, "after")
    curves.set_ylim(bottom=0)
    curves.set_title("pass@k", fontsize=9)
    curves.legend(fontsize=7, loc="lower right")
    fig.savefig(path)


def _plot_many(reports: list[EvalReport], labels: list[str], path: Path) -> None:
    fig = _figure(11, 4)
    bars, curves = fig.subplots(1, 2)
    values = [(r.greedy_pass_at_1 or 0) * 100 for r in reports]
    drawn = bars.bar(range(len(reports)), values)
    bars.bar_label(drawn, fmt="%.1f", fontsize=7)
    bars.set_xticks(list(range(len(reports))), labels, rotation=30, ha="right", fontsize=7)
    bars.set_ylabel("greedy pass@1 (%)")
    bars.set_title("greedy pass@1", fontsize=9)
    bars.grid(axis="y", alpha=0.3)
    for label, report in zip(labels, reports, strict=True):
        _draw_curve(curves, report, label)
    curves.set_ylim(bottom=0)
    curves.set_title("pass@k", fontsize=9)
    curves.legend(fontsize=6, loc="lower right")
    fig.savefig(path)


def _count(value: int | None) -> str:
    """A count, `-` where a report does not have it (written before it was counted)."""
    return "-" if value is None else str(value)
