"""Evaluation: pass@k of a model (or adapter) on a set of tasks, with reports and plots.

report = await evaluate(tasks, GeneratorClient(url), SandboxClient(url), EvalConfig(n=10))
write_report(report, "reports/baseline")      # report.json, report.md, pass_at_k.png
compare_reports(before, after, "reports/cmp")  # comparison.md, comparison.png
"""

from .config import EvalConfig
from .passk import mean_pass_at_k, pass_at_k
from .report import Category, EvalReport, ProblemResult, SampleResult, Timing
from .runner import EvalProgress, evaluate, task_seed
from .writers import compare_many, compare_reports, load_report, render_markdown, write_report

__all__ = [
    "Category",
    "EvalConfig",
    "EvalProgress",
    "EvalReport",
    "ProblemResult",
    "SampleResult",
    "Timing",
    "compare_many",
    "compare_reports",
    "evaluate",
    "load_report",
    "mean_pass_at_k",
    "pass_at_k",
    "render_markdown",
    "task_seed",
    "write_report",
]
