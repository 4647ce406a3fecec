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

Kept out of `jobs.py` on purpose (a module of its own, pure pydantic like the rest of the specs).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# Methods whose step samples groups (and nothing else between steps): the ones that may overlap.
GROUP_METHODS = ("grpo", "srrl")


def _error(kind: str, field: str, reason: str) -> PydanticCustomError:
    # The form of `crucible_shared.jobs.unused` / `invalid`: the gateway reports `field` as the
    # error's field (crucible_shared.http.error_field).
    return PydanticCustomError(kind, "{field}: {reason}", {"field": field, "reason": reason})


class OverlapSpec(BaseModel):
    """Rollouts that overlap the update (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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
                default = type(self).model_fields[name].get_default()
                if getattr(self, name) != default:
                    raise _error(
                        "unused_field",
                        name,
                        "max_staleness is 0: rollouts are on-policy and nothing is corrected",
                    )
        return self


def check_job(overlap: OverlapSpec, method: Any, publish: Any) -> None:
    """Cross-section rules of a train job (called by `TrainJob`'s validator): overlap applies to
    group-sampling methods, and needs a version published after every update."""
    if overlap.max_staleness == 0:
        return
    name = getattr(method, "name", "?")
    if name not in GROUP_METHODS:
        raise _error(
            "value_error",
            "overlap.max_staleness",
            f"method {name} does not sample groups, so its rollouts cannot overlap the update "
            f"(overlap works for {', '.join(GROUP_METHODS)}); set max_staleness to 0",
        )
    if publish.every != 1:
        raise _error(
            "value_error",
            "overlap.max_staleness",
            f"overlapped rollouts need a version after every update (publish.every is {publish.every}); "
            "set publish.every to 1",
        )
