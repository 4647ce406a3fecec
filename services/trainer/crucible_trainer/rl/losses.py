"""Policy-gradient losses on per-token log-probabilities (torch).

All take `logp` (new policy), `old_logp` (behaviour policy, detached), `ref_logp` (reference,
optional), per-sequence `advantages` and a `mask` of completion tokens, each [batch, tokens].

Each loss is a sum over the micro-batch divided by a `denominator`: by default the micro-batch's
own count (its sequences, or its tokens for the token-level loss), which makes the loss a mean
over the rows given. `rl/update.py` passes the count of the whole batch instead (zero-advantage
samples included, though it never computes them), which is how the published objectives
normalise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class LossOut:
    """A micro-batch's loss and its statistics. The statistics stay where the loss is (`stats`,
    detached: clip fraction, mean KL, mean ratio), so a loop over micro-batches sums them there
    and reads them once instead of waiting for the device three times per micro-batch."""

    loss: torch.Tensor
    stats: torch.Tensor  # [3]

    @property
    def clip_fraction(self) -> float:
        return float(self.stats[0])

    @property
    def kl(self) -> float:
        return float(self.stats[1])

    @property
    def ratio_mean(self) -> float:
        return float(self.stats[2])


def _stats(like: torch.Tensor, clip_fraction, kl, ratio_mean) -> torch.Tensor:
    """[clip fraction, KL, ratio], each a detached 0-d tensor or a number, on `like`'s device."""
    parts = [
        torch.as_tensor(v, dtype=torch.float32, device=like.device).detach()
        for v in (clip_fraction, kl, ratio_mean)
    ]
    return torch.stack(parts)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["sequence", "token", "dr_grpo"],
    max_tokens: int,
    denominator: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses (TRL's `loss_type` in brackets):

    * `sequence` [grpo]: each sequence's mean over its tokens, summed, / sequences;
    * `token` [dapo]: the sum over every token / tokens;
    * `dr_grpo` [dr_grpo]: the sum over every token / (sequences * max_tokens).

    `denominator` is the sequence count (`sequence`, `dr_grpo`) or the token count (`token`);
    None: this micro-batch's own, i.e. a mean over its rows.
    """
    if mode == "sequence":
        total = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    elif mode == "token":
        total = (per_token * mask).sum()
    else:
        total = (per_token * mask).sum() / max_tokens
    if denominator is not None:
        return total / denominator
    return total / (mask.sum().clamp(min=1) if mode == "token" else per_token.shape[0])


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
    denominator: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> LossOut:
    """PPO/GRPO clipped objective (negated, to minimise), plus beta * KL(policy || reference).

    `ratio_mode="token"` clips each token's ratio p_new/p_old; `"sequence"` clips one ratio per
    completion, exp(sum log p_new - sum log p_old), and averages the clipped surrogate over
    sequences (the REINFORCE/PPO codebase's form; `aggregation` does not apply to it).
    KL uses the k3 estimator exp(ref - logp) - (ref - logp) - 1, which is unbiased and >= 0.
    `denominator`: see `aggregate` (sequences for `ratio_mode="sequence"`).
    `token_weights` (detached, [batch, tokens]) multiply each token's loss, KL included: the
    off-policy correction of rl/correction.py. None leaves the loss exactly as without it.
    """
    if ratio_mode == "sequence":
        if token_weights is not None:
            raise ValueError("token weights apply to token-level ratios only")
        return _sequence_clipped(logp, old_logp, advantages, mask, clip_eps, clip_eps_high, denominator)
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    high = clip_eps_high if clip_eps_high is not None else clip_eps
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl_value: torch.Tensor | float = 0.0
    if ref_logp is not None and kl_beta > 0:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + kl_beta * kl
        kl_value = (kl.detach() * mask).sum() / mask.sum().clamp(min=1)
    if token_weights is not None:
        per_token = per_token * token_weights
    with torch.no_grad():
        was_clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
        clip_fraction = (was_clipped.float() * mask).sum() / mask.sum().clamp(min=1)
        ratio_mean = (ratio * mask).sum() / mask.sum().clamp(min=1)
    loss = aggregate(per_token, mask, aggregation, max_tokens, denominator)
    return LossOut(loss, _stats(loss, clip_fraction, kl_value, ratio_mean))


def _sequence_clipped(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
    denominator: float | None = None,
) -> LossOut:
    high = clip_eps_high if clip_eps_high is not None else clip_eps
    ratio = torch.exp(((logp - old_logp) * mask).sum(-1))
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high) * advantages
    loss = -torch.minimum(ratio * advantages, clipped).sum() / (denominator or ratio.shape[0])
    with torch.no_grad():
        was_clipped = ((ratio < 1 - clip_eps) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
        clip_fraction = was_clipped.float().mean()
    return LossOut(loss, _stats(loss, clip_fraction, 0.0, ratio.detach().mean()))


def reinforce(
    logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, denominator: float | None = None
) -> LossOut:
    """-A * log p(completion), summed over sequences / `denominator` (default: their count)."""
    seq_logp = (logp * mask).sum(-1)
    loss = -(advantages * seq_logp).sum() / (denominator or seq_logp.shape[0])
    return LossOut(loss, _stats(loss, 0.0, 0.0, 1.0))
