"""The policy update shared by every method: micro-batches, accumulation, iterations/epochs.

Without a KL term a sample of zero advantage adds nothing to the loss or its gradient, so it is
never run through the model (TRL runs forward and backward for it). It still counts where the
published objectives count it, in the normaliser: the whole batch's sequences (`sequence`, TRL's
`grpo`; `dr_grpo`, times `max_tokens`) or tokens (`token`, DAPO), as TRL's
`GRPOTrainer._compute_loss` computes them. A step whose only informative group is one of eight
therefore moves the policy an eighth as far as a step where all eight are informative.

Gradient accumulation splits the batch into several optimizer steps (`grad_accum` micro-batches
each), and each step is normalised as TRL normalises one accumulation step of a generation batch
split over `S` optimizer steps: the token loss by the whole batch's tokens (TRL's
`num_items_in_batch`), the sequence losses by the sequences of one step's share, `N / S`, with
`S = ceil(N / (micro_batch * grad_accum))` counted over the whole batch.

Over several data-parallel ranks (`crucible_trainer.distributed`) every rank holds the whole
batch, so the normaliser is the whole batch's; `parallel` gives each rank its share of every
optimizer step's micro-batches, and the gradients are summed across ranks before the step.

Since every micro-batch is divided by the whole batch's count, which samples share a micro-batch
changes no gradient: each optimizer step's micro-batches are filled longest first (`bucketed`),
so each pads to its own longest sequence. A step that runs out of GPU memory in one process runs
again from its first micro-batch with the policy holding less (`_fitting`, `Policy.spare_memory`),
counted in `update/out_of_memory_retries`. The update times its parts (`rl/timing.py`) and
reports its model FLOPs, tokens per second and share of the card's peak (`rl/throughput.py`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from crucible_trainer.rl import losses, throughput
from crucible_trainer.rl.batch import make_batch, right_align
from crucible_trainer.rl.correction import Correction
from crucible_trainer.rl.parallel import LOCAL, Parallel
from crucible_trainer.rl.policy import Policy
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.timing import PartTimer

log = logging.getLogger(__name__)


@dataclass
class UpdateConfig:
    objective: Literal["clip", "reinforce"] = "clip"
    iterations: int = 1  # GRPO's mu, or PPO's epochs
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_beta: float = 0.0
    aggregation: Literal["sequence", "token", "dr_grpo"] = "token"
    micro_batch: int = 16
    grad_accum: int | None = None  # micro-batches per optimizer step; None: all of them
    max_tokens: int = 256  # Dr. GRPO's constant normaliser
    always_score_old: bool = False  # PPO: log p_old from a separate no-grad pass
    ratio: Literal["token", "sequence"] = "token"  # PPO: one ratio per token or per completion
    tis_cap: float | None = None  # overlapped rollouts: truncated importance sampling (rl/correction.py)
    length_buckets: bool = True  # each optimizer step's micro-batches grouped by length (`bucketed`)


@dataclass(frozen=True)
class Normaliser:
    """What each micro-batch's loss sum is divided by."""

    sequences: float  # `sequence` / `dr_grpo` / sequence-level ratios / REINFORCE
    tokens: float  # `token`

    @classmethod
    def of(cls, batch: list[Sample], micro_batch: int, grad_accum: int | None) -> Normaliser:
        """The published normaliser of `batch`: every scored sample (zero advantage included),
        per optimizer step as the module docstring says."""
        scored = [s for s in batch if s.reward is not None]
        steps = 1 if grad_accum is None else max(1, math.ceil(len(scored) / (micro_batch * grad_accum)))
        return cls(len(scored) / steps, float(sum(len(s.completion_ids) for s in scored)))


def trainable(batch: list[Sample], kl_beta: float) -> list[Sample]:
    """Samples that carry gradient: scored, non-empty, and (without KL) with a non-zero advantage."""
    keep = [s for s in batch if s.reward is not None and s.completion_ids]
    if kl_beta == 0:
        keep = [s for s in keep if abs(s.advantage) > 1e-8]
    return keep


def bucketed(step: list[list[int]], lengths: list[tuple[int, int]]) -> list[list[int]]:
    """One optimizer step's micro-batches refilled with the same samples, longest first, each
    keeping its size (so a data-parallel rank runs as many as before): every micro-batch pads to
    its own longest sequence instead of holding long and short ones together. Each micro-batch's
    loss is divided by the whole batch's count (`Normaliser`), so which samples share one changes
    no gradient (tests/unit/test_update_buckets.py). `lengths`: (prompt, completion) tokens.

    >>> bucketed([[0, 1], [2, 3], []], [(5, 1), (1, 1), (9, 2), (3, 1)])
    [[2, 0], [3, 1], []]
    """
    items = sorted((i for m in step for i in m), key=lambda i: (sum(lengths[i]), lengths[i][1]), reverse=True)
    out, start = [], 0
    for m in step:
        out.append(items[start : start + len(m)])
        start += len(m)
    return out


def update(
    policy: Policy, batch: list[Sample], cfg: UpdateConfig, seed: int = 0, parallel: Parallel = LOCAL
) -> dict[str, float]:
    """Run `cfg.iterations` passes over `batch`; returns averaged metrics (and per-iteration ratios).
    `parallel`: this process's share of the work when several ranks update one policy."""
    samples = trainable(batch, cfg.kl_beta)
    norm = Normaliser.of(batch, cfg.micro_batch, cfg.grad_accum)
    metrics: dict[str, float] = {
        "update/sequences": float(len(samples)),
        "update/normaliser_sequences": norm.sequences,
        "update/normaliser_tokens": norm.tokens,
    }
    if not samples:
        metrics.update({"loss": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "kl": 0.0})
        return metrics
    prompts = [s.prompt_ids for s in samples]
    comps = [s.completion_ids for s in samples]
    lengths = [(len(p), len(c)) for p, c in zip(prompts, comps, strict=True)]
    timer = PartTimer(policy.device)
    passes = replace(policy.passes)
    order = list(range(len(samples)))
    first_plan = parallel.plan(order, cfg.micro_batch, cfg.grad_accum)
    # log p_old is the policy before the update. When the first pass is one optimizer step in one
    # process, its forwards run on exactly that policy, so they give log p_old (a ratio of 1, as
    # TRL does); otherwise (several optimizer steps per pass, or ranks that train other shares in
    # later passes) a no-grad pass scores every sample first.
    wants_old = cfg.iterations > 1 or cfg.always_score_old
    reuse_old = wants_old and parallel.world == 1 and len(first_plan) == 1
    t0 = time.perf_counter()
    old: list[Any] | None = None
    if wants_old and not reuse_old:
        with timer.part("old"):
            old = parallel.score(policy, prompts, comps, cfg.micro_batch)
    ref: list[Any] | None = None
    if cfg.kl_beta > 0:
        with timer.part("ref"):
            ref = parallel.score(policy, prompts, comps, cfg.micro_batch, reference=True)
    t1 = time.perf_counter()
    tis = Correction(cfg.tis_cap) if cfg.tis_cap is not None else None
    if tis is not None and (cfg.objective != "clip" or cfg.ratio != "token"):
        raise ValueError("the importance-sampling correction needs the clipped objective with token ratios")
    rng = random.Random(seed)
    # Figures stay on the device until the end: reading one waits for every queued kernel.
    zero = torch.zeros((), dtype=torch.float32, device=policy.device)
    loss_sum, clip_sum, kl_sum = zero, zero, zero
    grad_norm_sum = 0.0
    counts = {"micro": 0, "steps": 0, "skipped": 0, "retried": 0, "oom": 0}

    def step_passes(micro: list[list[int]], iteration: int, keep: list[Any] | None) -> tuple[list[Any], int]:
        """Forward and backward of one optimizer step's micro-batches: the sums of their loss, clip
        fraction, KL and ratio, and how many ran here."""
        step_sums = [zero, zero, zero, zero]
        step_micro = 0
        for m, idx in enumerate(micro):
            parallel.begin(last=m == len(micro) - 1)
            with timer.part("forward_backward"):
                if not idx:  # no share of this micro-batch here: its collectives still run
                    parallel.backward(parallel.idle_loss(policy))
                    continue
                out = _micro_loss(policy, samples, idx, cfg, norm, old, ref, tis, iteration == 0, keep)
                parallel.backward(out.loss)
            values = [out.loss.detach(), *out.stats[:3]]
            step_sums = [a + b for a, b in zip(step_sums, values, strict=True)]
            step_micro += 1
        return step_sums, step_micro

    for iteration in range(cfg.iterations):
        if iteration > 0:
            rng.shuffle(order)
        plan = first_plan if iteration == 0 else parallel.plan(order, cfg.micro_batch, cfg.grad_accum)
        keep: list[Any] | None = [None] * len(samples) if reuse_old and iteration == 0 else None
        ratio_sum, ratio_n = zero, 0
        for micro in plan:
            if cfg.length_buckets:
                micro = bucketed(micro, lengths)
            # A step whose gradient is not finite is run again under the policy's fallback kernels
            # (`Policy.fallbacks`: without the fused kernels, or eager), then skipped if still not finite.
            for attempt, kernels in enumerate([nullcontext, *policy.fallbacks]):
                with kernels():
                    step_sums, step_micro = _fitting(
                        step_passes, policy, parallel, counts, micro, iteration, keep
                    )
                with timer.part("allreduce"):
                    parallel.reduce(policy)
                grad_norm, again = optimizer_step(policy, timer, attempt)
                counts["retried"] += int(attempt == 0 and again)
                if not again:
                    break
            loss_sum, clip_sum, kl_sum = (
                loss_sum + step_sums[0],
                clip_sum + step_sums[1],
                kl_sum + step_sums[2],
            )
            ratio_sum = ratio_sum + step_sums[3]
            ratio_n += step_micro
            counts["micro"] += step_micro
            if math.isfinite(grad_norm):
                grad_norm_sum += grad_norm
                counts["steps"] += 1
            else:
                counts["skipped"] += 1
        if keep is not None:
            old = keep
        ratio_total, ratio_count = parallel.sum([ratio_sum, ratio_n])
        metrics[f"update/ratio_mean_iter{iteration}"] = ratio_total / max(ratio_count, 1)
    t2 = time.perf_counter()
    # Sums over every rank's micro-batches (the gradient norm is the same on every rank).
    loss, clip, kl, micro_count = parallel.sum([loss_sum, clip_sum, kl_sum, counts["micro"]])
    metrics["loss"] = loss / cfg.iterations
    metrics["clip_fraction"] = clip / max(micro_count, 1)
    metrics["kl"] = kl / max(micro_count, 1)
    metrics["grad_norm"] = grad_norm_sum / max(counts["steps"], 1)
    metrics["update/optimizer_steps"] = float(counts["steps"])
    metrics["update/skipped_nonfinite_steps"] = float(counts["skipped"])
    metrics["update/retried_nonfinite_steps"] = float(counts["retried"])
    metrics["update/out_of_memory_retries"] = float(counts["oom"])
    metrics["update/memory_margin"] = float(policy.memory_margin)
    metrics.update(policy.passes.since(passes))
    # Where the update's time goes (wall times; each optimizer step reads the gradient norm, so
    # they include the device's work): scoring old / reference log-probs (with the gather of every
    # rank's share), then the passes of forward, backward and optimizer steps (with the gradients'
    # all-reduce and the wait for the slowest rank). The parts: docs/benchmarks.md.
    metrics["time/update_score_s"] = t1 - t0
    metrics["time/update_passes_s"] = t2 - t1
    parts = timer.seconds()
    for part in ("ref", "old", "forward_backward", "allreduce", "optimizer"):
        metrics[f"time/update_{part}_s"] = parts.get(part, 0.0)
    metrics.update(
        throughput.update_figures(
            policy,
            lengths,
            iterations=cfg.iterations,
            seconds={**parts, "total": t2 - t0},
            gpus=parallel.world,
            scored_old=wants_old and not reuse_old,
            scored_ref=ref is not None,
        )
    )
    if tis is not None:
        metrics.update(tis.metrics())  # this rank's samples
    return metrics


def _fitting(
    run: Any, policy: Policy, parallel: Parallel, counts: dict[str, int], *args: Any
) -> tuple[list[Any], int]:
    """`run(*args)`, run again from its first micro-batch, its gradients dropped, each time it
    runs out of GPU memory while the policy can hold less (`Policy.spare_memory`: the estimate
    that let it run without the chunked head or checkpointing was too low). Several ranks do not
    retry: the others would wait in a collective for this one."""
    while True:
        try:
            return run(*args)
        except torch.OutOfMemoryError:
            if parallel.world > 1 or not policy.spare_memory():
                raise
        # Out of the handler: the exception's frames, which hold the failed pass's tensors, are gone.
        counts["oom"] += 1
        drop_failed_pass(policy)


def drop_failed_pass(policy: Policy) -> None:
    """After a pass ran out of memory (and its tensors are gone): its gradients dropped, the cached
    blocks handed back, before the step runs again."""
    policy.optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def optimizer_step(policy: Policy, timer: PartTimer, attempt: int) -> tuple[float, bool]:
    """The optimizer step after pass `attempt` (0: the policy's own kernels, then each of
    `policy.fallbacks`): its gradient norm, and whether the step is to run again under the next
    fallback (a norm that is not finite, logged; `Policy.step` took no step)."""
    with timer.part("optimizer"):
        grad_norm = policy.step()
    if math.isfinite(grad_norm):
        return grad_norm, False
    again = attempt < len(policy.fallbacks)
    log.warning(
        "gradient norm %s is not finite: %s",
        grad_norm,
        "running the step again with fallback kernels" if again else "optimizer step skipped",
    )
    return grad_norm, again


def _micro_loss(
    policy: Policy,
    samples: list[Sample],
    idx: list[int],
    cfg: UpdateConfig,
    norm: Normaliser,
    old: list[list[float]] | None,
    ref: list[list[float]] | None,
    tis: Correction | None = None,
    first: bool = True,
    keep: list[Any] | None = None,
) -> losses.LossOut:
    """The loss of the micro-batch of samples `idx`, normalised by the whole batch (`norm`).
    `keep`: where to put each sample's log-probs (detached, on the device), as later passes' p_old."""
    prompts = [samples[i].prompt_ids for i in idx]
    comps = [samples[i].completion_ids for i in idx]
    b = make_batch(prompts, comps, policy.pad_id, policy.device)
    adv = torch.tensor([samples[i].advantage for i in idx], dtype=torch.float32, device=policy.device)
    logp = policy.token_logprobs(b)
    if keep is not None:
        detached = logp.detach()
        for row, i in enumerate(idx):
            keep[i] = detached[row, b.tail - len(comps[row]) :]
    if cfg.objective == "reinforce":
        out = losses.reinforce(logp, adv, b.tail_mask, norm.sequences)
    else:
        old_lp = aligned([old[i] for i in idx], b.tail, policy.device) if old is not None else logp.detach()
        ref_lp = aligned([ref[i] for i in idx], b.tail, policy.device) if ref is not None else None
        out = losses.clipped_surrogate(
            logp,
            old_lp,
            adv,
            b.tail_mask,
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            ref_logp=ref_lp,
            kl_beta=cfg.kl_beta,
            aggregation=cfg.aggregation,
            max_tokens=cfg.max_tokens,
            ratio_mode=cfg.ratio,
            denominator=norm.tokens
            if cfg.aggregation == "token" and cfg.ratio == "token"
            else norm.sequences,
            token_weights=None
            if tis is None
            else tis.weights(old_lp, [samples[i] for i in idx], b.tail_mask, b.tail, first),
        )
    return out


def aligned(rows: list[Any], tail: int, device: str) -> torch.Tensor:
    """Per-token values placed like `Batch.tail_mask`: lists of numbers (scored), or 1-d tensors
    already on the device (kept from the first pass)."""
    if not rows or not isinstance(rows[0], torch.Tensor):
        return right_align(rows, tail, device)
    out = torch.zeros((len(rows), tail), dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        if r.numel():
            out[i, tail - r.numel() :] = r
    return out
