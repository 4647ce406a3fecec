"""SRRL (self-refined RL): first attempts (c1); every failed one gets a refinement prompt built from
its sandbox result and c2 refinements at a lower temperature; c1 and c2 train together with
advantages normalised per problem (config: `crucible_shared.jobs.SRRLConfig`). A problem's c1
and c2 samples are one group, for the group filters too."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from crucible_shared.jobs import SRRLConfig

from crucible_trainer import tasks
from crucible_trainer.methods.clipped import update_config as update_config  # GRPO, SRRL, SPIRAL share it
from crucible_trainer.methods.groups import (
    Judge,
    assign_group_advantages,
    pre_filter,
    select_groups,
    zero_signal_metrics,
)
from crucible_trainer.rl.context import StepContext, first_prompts, reward_metrics
from crucible_trainer.rl.rollout import Prompt, Sample


def refinements_per_failure(cfg: SRRLConfig, failures: int) -> int:
    """c2 per failed first attempt, capped so c1 + all refinements stay within the budget.

    >>> refinements_per_failure(SRRLConfig(c1=2, c2=4, budget=10), 2)
    4
    >>> refinements_per_failure(SRRLConfig(c1=4, c2=4, budget=10), 4)
    1
    >>> refinements_per_failure(SRRLConfig(c1=9, c2=4, budget=10), 9)
    0
    """
    if failures == 0:
        return 0
    return max(0, min(cfg.c2, (cfg.budget - cfg.c1) // failures))


def _failed(s: Sample) -> bool:
    return s.reward is not None and s.result is not None and s.result.status != "passed"


def _refined_code(text: str, task: object) -> str:
    return tasks.extract_refined_code(text)


async def attempt_and_refine(
    ctx: StepContext, cfg: SRRLConfig, indices: list[int], offset: int, round: int
) -> tuple[list[Sample], dict[str, float]]:
    """c1 first attempts per problem, then c2 refinements of each failed one; with counters."""
    first = await ctx.sample(first_prompts(ctx, indices, offset), cfg.c1, round=round)
    refine: list[Prompt] = []
    counts: list[int] = []
    for group in range(offset, offset + len(indices)):
        failed = [k for k, s in enumerate(first) if s.group == group and _failed(s)]
        per = refinements_per_failure(cfg, len(failed))
        for k in failed if per else []:
            s = first[k]
            text = ctx.prompts.refinement(s.task_index, s.code, s.result, cfg.feedback)
            refine.append(Prompt(task_index=s.task_index, group=group, text=text, phase="c2", parent=k))
            counts.append(per)
    second: list[Sample] = []
    # Requests with the same n go together; counts differ only between problems.
    for per in sorted(set(counts)):
        chosen = [p for p, c in zip(refine, counts, strict=True) if c == per]
        second += await ctx.sample(
            chosen,
            per,
            temperature=cfg.c2_temperature,
            max_tokens=cfg.refine_max_tokens,
            extract=_refined_code,
            round=round,
        )
    c1_failed = {k for k, s in enumerate(first) if _failed(s)}
    rescued = {s.parent for s in second if s.result and s.result.status == "passed"} & c1_failed
    stats = {
        "c1_scored": float(sum(1 for s in first if s.reward is not None)),
        "c1_passed": float(sum(1 for s in first if s.reward is not None and s.result.status == "passed")),
        "c1_failed": float(len(c1_failed)),
        "c1_rescued": float(len(rescued)),
        "c2_samples": float(len(second)),
        "problems": float(len(indices)),
    }
    return first + second, stats


def judge(cfg: SRRLConfig) -> Judge | None:
    return pre_filter(cfg.filter)


async def collect(
    ctx: StepContext, cfg: SRRLConfig, indices: list[int]
) -> tuple[list[Sample], dict[str, float]]:
    async def groups(chosen: list[int], offset: int, round: int) -> tuple[list[Sample], dict[str, float]]:
        return await attempt_and_refine(ctx, cfg, chosen, offset, round)

    batch, sampled, c, filter_metrics = await select_groups(ctx, cfg.filter, indices, groups)
    assign_group_advantages(batch, cfg.scale)
    metrics = {**reward_metrics(sampled), **zero_signal_metrics(sampled), **filter_metrics}
    metrics["c1_pass_rate"] = c["c1_passed"] / c["c1_scored"] if c["c1_scored"] else 0.0
    metrics["c2_rescue_rate"] = c["c1_rescued"] / c["c1_failed"] if c["c1_failed"] else 0.0
    metrics["refinements_per_problem"] = c["c2_samples"] / c["problems"]
    return batch, metrics


def refinement_stats(rollouts_dir: Path) -> list[dict[str, Any]]:
    """Per problem, over the whole run: first attempts, how many passed, refinements, how many of
    those passed, and failed first attempts rescued by at least one refinement."""
    stats: dict[str, dict[str, int]] = defaultdict(
        lambda: {"c1": 0, "c1_passed": 0, "c2": 0, "c2_passed": 0, "c1_failed": 0, "rescued": 0}
    )
    for path in sorted(rollouts_dir.glob("step-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rescued = {r["parent"] for r in rows if r["phase"] == "c2" and r["status"] == "passed"}
        for r in rows:
            s = stats[r["problem_id"]]
            passed = r["status"] == "passed"
            if r["phase"] == "c1":
                s["c1"] += 1
                s["c1_passed"] += passed
                if r["status"] not in ("passed", None):
                    s["c1_failed"] += 1
                    s["rescued"] += r["sample"] in rescued
            else:
                s["c2"] += 1
                s["c2_passed"] += passed
    return [{"problem_id": k, **v} for k, v in sorted(stats.items())]


def report(cfg: SRRLConfig, run_dir: Path) -> dict[str, Any]:
    """`refinements.json` and `refinements.md`: SRRL's per-problem refinement statistics."""
    rows = refinement_stats(run_dir / "rollouts")
    if not rows:
        return {}
    (run_dir / "refinements.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Refinements per problem",
        "",
        "| problem | first attempts | passed | refinements | passed | failed attempts rescued |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['problem_id']} | {r['c1']} | {r['c1_passed']} | {r['c2']} | {r['c2_passed']} "
            f"| {r['rescued']} of {r['c1_failed']} |"
        )
    failed = sum(r["c1_failed"] for r in rows)
    rescued = sum(r["rescued"] for r in rows)
    lines += ["", f"Overall: {rescued} of {failed} failed first attempts rescued."]
    (run_dir / "refinements.md").write_text("\n".join(lines) + "\n")
    return {
        "refinements": str(run_dir / "refinements.md"),
        "refinements_per_problem": sum(r["c2"] for r in rows) / len(rows),
        "c2_rescue_rate": rescued / failed if failed else 0.0,
    }
