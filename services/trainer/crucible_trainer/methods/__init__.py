"""The method registry: each method's config class maps to the module that implements it.

Every method module has the same protocol (`MethodModule`): `judge` (its pre-filter's judge of
which problems are worth training on, or None: every problem trains), `collect` (one step's
samples with their advantages, and metrics), `update_config` (how the policy update runs over
them) and `report` (once, at the end: what the method adds to the run's report, from the run
dir). The training loop dispatches through `REGISTRY` alone. Adding a method is one module here,
one config class in `crucible_shared.jobs` (in its `Method` union) and one line below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, cast

from crucible_shared.jobs import GRPOConfig, PPOConfig, ReinforceConfig, SpiralConfig, SRRLConfig, TrainJob

from crucible_trainer.methods import grpo, ppo, reinforce, spiral, srrl
from crucible_trainer.methods.groups import Judge
from crucible_trainer.rl.context import StepContext
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig


class MethodModule(Protocol):
    def judge(self, cfg: Any) -> Judge | None: ...

    async def collect(
        self, ctx: StepContext, cfg: Any, indices: list[int]
    ) -> tuple[list[Sample], dict[str, float]]: ...

    def update_config(self, cfg: Any, job: TrainJob) -> UpdateConfig: ...

    def report(self, cfg: Any, run_dir: Path) -> dict[str, Any]: ...


REGISTRY: dict[type, Any] = {
    GRPOConfig: grpo,
    SRRLConfig: srrl,
    ReinforceConfig: reinforce,
    PPOConfig: ppo,
    SpiralConfig: spiral,
}


def method_module(cfg: Any) -> MethodModule:
    """The module implementing `cfg`'s method."""
    try:
        return cast(MethodModule, REGISTRY[type(cfg)])
    except KeyError:
        raise ValueError(f"no method module is registered for {type(cfg).__name__}") from None
