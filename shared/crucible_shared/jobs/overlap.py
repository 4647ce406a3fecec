"""The train spec's `overlap` section: rollouts generated while the policy updates, and the
correction of the policy lag that brings.

`max_staleness: s` lets step k+1's rollouts be generated while step k updates, from a policy at
most `s` versions older than the one the update starts from (0: today's synchronous loop, where a
step samples from exactly the version it updates). Samples of an older version are off-policy;
the loss corrects them with truncated importance sampling (`correction: tis`, as TRL's
`vllm_importance_sampling_correction`, verl's and prime-rl's): every token's loss is weighted by
`min(exp(logp_trainer_old - logp_behaviour), cap)`, the behaviour log-probs being the ones the
generator reported when it sampled the token.

Only methods that sample groups of completions per prompt overlap (GRPO, SRRL): their step is a
pure function of the problems and the served version. REINFORCE and PPO have no groups, SPIRAL
folds each step's returns into baselines the next step reads, and SFT / DPO sample nothing.

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from crucible_shared.jobs.base import _Spec, invalid, unused
from crucible_shared.jobs.sections import PublishSpec


class OverlapSpec(_Spec):
    """Rollouts that overlap the update (see the module docstring)."""

    max_staleness: int = Field(
        0,
        ge=0,
        le=8,
        description="Most versions a step's rollouts may lag the policy it updates (0: synchronous).",
    )
    correction: Literal["tis"] = Field(
        "tis",
        description="tis: truncated importance sampling, each token's loss times "
        "min(exp(logp_old - logp_behaviour), cap).",
    )
    cap: float = Field(2.0, ge=1, le=1000, description="Truncation of the importance weights.")

    @model_validator(mode="after")
    def _check(self) -> OverlapSpec:
        if self.max_staleness == 0:
            for name in ("correction", "cap"):
                if self._changed(name):
                    raise unused(name, "max_staleness is 0: rollouts are on-policy and nothing is corrected")
        return self


def check_job(overlap: OverlapSpec, method: Any, publish: PublishSpec, group_methods: Sequence[str]) -> None:
    """Cross-section rules of a train job (called by `TrainJob`'s validator): overlap applies to
    group-sampling methods (`samples_groups` on the method's config class; `group_methods` names
    them all), and needs a version published after every update."""
    if overlap.max_staleness == 0:
        return
    if not type(method).samples_groups:
        raise invalid(
            "overlap.max_staleness",
            f"method {method.name} does not sample groups, so its rollouts cannot overlap the update "
            f"(overlap works for {', '.join(group_methods)}); set max_staleness to 0",
        )
    if publish.every != 1:
        raise invalid(
            "overlap.max_staleness",
            f"overlapped rollouts need a version after every update (publish.every is {publish.every}); "
            "set publish.every to 1",
        )
