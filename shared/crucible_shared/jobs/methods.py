"""The online RL methods' configs: GRPO, SRRL, REINFORCE, PPO, and the group filter they share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from crucible_shared.jobs.base import _Method, _Spec, invalid, unused
from crucible_shared.jobs.compat import filter_from_difficulty


class GroupFilter(_Spec):
    """Which groups of samples train: all, those of a one-off pre-filter, or dynamic sampling.

    Groups whose rewards are all equal have zero advantage and carry no gradient. `pre` judges
    every problem from `pre_samples` samples of the starting policy (before training, or on a GPU
    while it trains) and keeps those with 0 < pass rate < 1 (`pre_keep: pass_rate`) or, with
    `pre_keep: reward_spread`, those whose samples' rewards differ under the job's reward (a
    fraction-of-tests reward also keeps problems partly solved).
    `dynamic` (DAPO's dynamic sampling) drops zero-variance groups during training and samples
    groups of fresh problems until the step has `problems_per_step` informative ones, drawing
    at most `max_draw_factor` times that many groups per step.
    """

    mode: Literal["none", "pre", "dynamic"] = Field("none", description="none | pre | dynamic.")
    pre_samples: int = Field(4, ge=2, le=64, description="pre: samples per problem in the pre-filter pass.")
    pre_keep: Literal["pass_rate", "reward_spread"] = Field(
        "pass_rate",
        description="pre: keep problems with 0 < pass rate < 1, or those whose samples' rewards differ.",
    )
    max_draw_factor: float = Field(
        3.0, ge=1, le=32, description="dynamic: most groups sampled per step, as a multiple of the quota."
    )

    @model_validator(mode="after")
    def _check(self) -> GroupFilter:
        if self._changed("pre_samples") and self.mode != "pre":
            raise unused("pre_samples", f"only the pre-filter samples ahead (mode is {self.mode})")
        if self._changed("pre_keep") and self.mode != "pre":
            raise unused("pre_keep", f"only the pre-filter keeps problems ahead (mode is {self.mode})")
        if self._changed("max_draw_factor") and self.mode != "dynamic":
            raise unused("max_draw_factor", f"only dynamic sampling draws more groups (mode is {self.mode})")
        return self


Loss = Literal["sequence", "token", "dr_grpo"]


class ClippedMethod(_Method):
    """The fields and checks of the methods with a clipped ratio (GRPO, SRRL, SPIRAL), declared
    once; the trainer builds their update from these alone."""

    loss: Loss = Field(
        "token",
        description="Aggregation: mean per sequence, mean over all tokens (DAPO), or sum / max_tokens (Dr. GRPO).",
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range (low side, and high side unless set)."
    )
    kl_beta: float = Field(
        0.0, ge=0, le=100, description="KL penalty to the reference (the starting policy)."
    )
    num_iterations: int = Field(1, ge=1, le=16, description="mu: updates per batch of samples.")

    @property
    def clip_high(self) -> float | None:
        """The upper clip range when it differs from `clip_eps` (GRPO's clip-higher)."""
        return None

    @model_validator(mode="after")
    def _check_clip(self) -> ClippedMethod:
        if self.num_iterations == 1:
            for name in ("clip_eps", "clip_eps_high"):
                if name in type(self).model_fields and self._changed(name):
                    raise unused(
                        name,
                        "with num_iterations 1 the policy is updated once per batch, its ratio is 1 "
                        "and nothing is clipped; raise num_iterations or drop it",
                    )
        return self


class GRPOConfig(ClippedMethod):
    """Group Relative Policy Optimisation."""

    samples_groups = True
    per_problem = "group_size"

    name: Literal["grpo"] = "grpo"
    group_size: int = Field(8, ge=2, le=256, description="G: samples per prompt.")
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's / batch's std, or not."
    )
    clip_eps_high: float | None = Field(None, gt=0, lt=1, description="Clip-higher (DAPO) upper range.")
    filter: GroupFilter = Field(default_factory=GroupFilter, description="Which groups train.")

    @property
    def clip_high(self) -> float | None:
        return self.clip_eps_high

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        return filter_from_difficulty(data)  # jobs/compat.py


class SRRLConfig(ClippedMethod):
    """Self-refined RL: first attempts (c1), refinements of the failed ones (c2), trained together."""

    samples_groups = True
    per_problem = "budget"

    name: Literal["srrl"] = "srrl"
    c1: int = Field(2, ge=1, le=64, description="First attempts per problem.")
    c2: int = Field(4, ge=1, le=64, description="Refinements per failed first attempt.")
    c2_temperature: float = Field(0.3, ge=0, le=5, description="Sampling temperature of refinements.")
    budget: int = Field(
        10, ge=2, le=4096, description="Max samples per problem (c1 + all c2), matched to GRPO's G."
    )
    refine_max_tokens: int | None = Field(
        None, ge=1, le=8192, description="Max new tokens of a refinement (default: rollout's)."
    )
    feedback: Literal["first_failure", "all_tests"] = Field(
        "first_failure",
        description="What the refinement prompt shows: the first failing test, or every test's PASS/FAIL.",
    )
    scale: Literal["group", "none"] = Field(
        "group", description="Normalise advantages per problem by std, or only centre."
    )
    filter: GroupFilter = Field(
        default_factory=GroupFilter, description="Which problems train (a group is c1 + c2 of one problem)."
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        return filter_from_difficulty(data)  # jobs/compat.py

    @model_validator(mode="after")
    def _check(self) -> SRRLConfig:
        if self.c1 >= self.budget:
            raise invalid("c1", "must be smaller than budget so refinements fit in it")
        return self


class ReinforceConfig(_Method):
    """REINFORCE: loss = -(r - baseline) * log p(completion)."""

    per_problem = "samples"

    name: Literal["reinforce"] = "reinforce"
    samples: int = Field(1, ge=1, le=64, description="Samples per task.")
    baseline: bool = Field(True, description="Subtract the batch mean reward.")


class PPOConfig(_Method):
    """PPO-clip over stored rollouts with batch-normalised advantages."""

    per_problem = "samples"

    name: Literal["ppo"] = "ppo"
    epochs: int = Field(4, ge=1, le=64, description="Passes over each batch of rollouts.")
    clip_eps: float = Field(0.2, gt=0, lt=1)
    ratio: Literal["token", "sequence"] = Field(
        "token",
        description="Importance ratio per token, or one per completion: exp(sum logp_new - sum logp_old).",
    )
    samples: int = Field(1, ge=1, le=64, description="Samples per task.")
