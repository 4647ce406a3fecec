"""SRRL (self-refined RL): first attempts (c1); every failed one gets a refinement prompt built from
its sandbox result and c2 refinements at a lower temperature; c1 and c2 train together with
advantages normalised per problem (config: `crucible_shared.jobs.SRRLConfig`)."""

from __future__ import annotations

from crucible_shared.jobs import SRRLConfig

from crucible_trainer.rl.context import StepContext, first_prompts, reward_metrics
from crucible_trainer.rl.grpo import assign_group_advantages
from crucible_trainer.rl.rollout import Prompt, Sample
from crucible_trainer.rl.update import UpdateConfig


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


async def collect(
    ctx: StepContext,
    cfg: SRRLConfig,
    task_indices: list[int],
    build_prompt,
    build_refinement,
    extract_refined,
) -> tuple[list[Sample], dict[str, float]]:
    prompts = first_prompts(ctx, task_indices, build_prompt)
    first = await ctx.sample(prompts, cfg.c1)
    refine_prompts: list[Prompt] = []
    counts: list[int] = []
    for i, _t in enumerate(task_indices):
        failed = [
            s
            for s in first
            if s.group == i and s.reward is not None and s.result and s.result.status != "passed"
        ]
        per = refinements_per_failure(cfg, len(failed))
        for s in failed if per else []:
            k = first.index(s)
            text = ctx.render(build_refinement(s.task_index, s.code, s.result))
            refine_prompts.append(Prompt(task_index=s.task_index, group=i, text=text, phase="c2", parent=k))
            counts.append(per)
    second: list[Sample] = []
    # Requests with the same n go together; counts differ only between problems.
    for per in sorted(set(counts)):
        chosen = [p for p, c in zip(refine_prompts, counts, strict=True) if c == per]
        second += await ctx.sample(
            chosen,
            per,
            temperature=cfg.c2_temperature,
            max_tokens=cfg.refine_max_tokens,
            extract=extract_refined,
        )
    batch = first + second
    n_groups, zero = assign_group_advantages(batch, cfg.scale)
    metrics = reward_metrics(batch)
    c1_scored = [s for s in first if s.reward is not None]
    c1_failed = [
        k for k, s in enumerate(first) if s.reward is not None and s.result and s.result.status != "passed"
    ]
    rescued = {s.parent for s in second if s.result and s.result.status == "passed"}
    metrics["c1_pass_rate"] = (
        sum(1 for s in c1_scored if s.result.status == "passed") / len(c1_scored) if c1_scored else 0.0
    )
    metrics["c2_rescue_rate"] = len(rescued & set(c1_failed)) / len(c1_failed) if c1_failed else 0.0
    metrics["refinements_per_problem"] = len(second) / len(task_indices)
    metrics["zero_signal_groups"] = float(zero)
    metrics["zero_signal_fraction"] = zero / n_groups if n_groups else 1.0
    return batch, metrics


def update_config(cfg: SRRLConfig, micro_batch: int, grad_accum: int | None, max_tokens: int) -> UpdateConfig:
    return UpdateConfig(
        objective="clip",
        iterations=cfg.num_iterations,
        clip_eps=cfg.clip_eps,
        kl_beta=cfg.kl_beta,
        aggregation=cfg.loss,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        max_tokens=max_tokens,
    )
