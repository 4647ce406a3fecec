"""Policy-gradient losses on per-token log-probabilities (torch).

All take `logp` (new policy), `old_logp` (behaviour policy, detached), `ref_logp` (reference,
optional), per-sequence `advantages` and a `mask` of completion tokens, each [batch, tokens].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class LossOut:
    loss: torch.Tensor
    clip_fraction: float
    kl: float
    ratio_mean: float


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["sequence", "token", "dr_grpo"],
    max_tokens: int,
) -> torch.Tensor:
    """Reduce per-token losses: mean per sequence then over sequences; mean over all tokens (DAPO);
    or sum over tokens / max_tokens, mean over sequences (Dr. GRPO, no length bias)."""
    if mode == "sequence":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if mode == "token":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return ((per_token * mask).sum(-1) / max_tokens).mean()


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    aggregation: Literal["sequence", "token", "dr_grpo"] = "token",
    max_tokens: int = 1,
    ratio_mode: Literal["token", "sequence"] = "token",
) -> LossOut:
    """PPO/GRPO clipped objective (negated, to minimise), plus beta * KL(policy || reference).

    `ratio_mode="token"` clips each token's ratio p_new/p_old; `"sequence"` clips one ratio per
    completion, exp(sum log p_new - sum log p_old), and averages the clipped surrogate over
    sequences (the REINFORCE/PPO codebase's form; `aggregation` does not apply to it).
    KL uses the k3 estimator exp(ref - logp) - (ref - logp) - 1, which is unbiased and >= 0.
    """
    if ratio_mode == "sequence":
        return _sequence_clipped(logp, old_logp, advantages, mask, clip_eps, clip_eps_high)
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    high = clip_eps_high if clip_eps_high is not None else clip_eps
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl_value = 0.0
    if ref_logp is not None and kl_beta > 0:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + kl_beta * kl
        kl_value = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
    with torch.no_grad():
        was_clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
        clip_fraction = float((was_clipped.float() * mask).sum() / mask.sum().clamp(min=1))
        ratio_mean = float((ratio * mask).sum() / mask.sum().clamp(min=1))
    return LossOut(aggregate(per_token, mask, aggregation, max_tokens), clip_fraction, kl_value, ratio_mean)


def _sequence_clipped(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
) -> LossOut:
    high = clip_eps_high if clip_eps_high is not None else clip_eps
    ratio = torch.exp(((logp - old_logp) * mask).sum(-1))
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high) * advantages
    loss = -torch.minimum(ratio * advantages, clipped).mean()
    with torch.no_grad():
        was_clipped = ((ratio < 1 - clip_eps) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
        clip_fraction = float(was_clipped.float().mean())
    return LossOut(loss, clip_fraction, 0.0, float(ratio.detach().mean()))


def reinforce(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> LossOut:
    """-A * log p(completion), averaged over sequences."""
    seq_logp = (logp * mask).sum(-1)
    loss = -(advantages * seq_logp).mean()
    return LossOut(loss, 0.0, 0.0, 1.0)
