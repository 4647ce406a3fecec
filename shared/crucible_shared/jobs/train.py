"""The train job: a method config plus the sections it reads."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, model_validator

from crucible_shared.distributed import DistributedSpec
from crucible_shared.jobs.base import _ATTEMPTS, Seed, _Method, _Spec, invalid, unused
from crucible_shared.jobs.compat import group_size_from_rollout
from crucible_shared.jobs.data import DataSpec, ModelSpec
from crucible_shared.jobs.evaluation import TrainEvalSpec
from crucible_shared.jobs.games import SpiralConfig
from crucible_shared.jobs.methods import GRPOConfig, PPOConfig, ReinforceConfig, SRRLConfig
from crucible_shared.jobs.offline import DPOConfig, SFTConfig, check_offline_optim
from crucible_shared.jobs.overlap import OverlapSpec
from crucible_shared.jobs.overlap import check_job as check_overlap
from crucible_shared.jobs.sections import (
    CheckpointSpec,
    LoggingSpec,
    OptimSpec,
    PublishSpec,
    RewardSpec,
    RolloutSpec,
)
from crucible_shared.lifecycle import JobKind
from crucible_shared.text import Label

Method = Annotated[
    GRPOConfig | SRRLConfig | ReinforceConfig | PPOConfig | SpiralConfig | SFTConfig | DPOConfig,
    Field(discriminator="name"),
]

# The method config classes of the union; the names of those whose rollouts may overlap the
# update and of those trained offline, read from each class (`samples_groups`, `offline`).
METHOD_CONFIGS: tuple[type[_Method], ...] = get_args(get_args(Method)[0])
GROUP_METHODS: tuple[str, ...] = tuple(
    c.model_fields["name"].default for c in METHOD_CONFIGS if c.samples_groups
)
OFFLINE_METHODS: tuple[str, ...] = tuple(c.model_fields["name"].default for c in METHOD_CONFIGS if c.offline)


class TrainJob(_Spec):
    """A training job."""

    kind: Literal[JobKind.train] = JobKind.train
    name: Label | None = Field(None, max_length=200, description="Label shown in listings (printable text).")
    method: Method = Field(default_factory=GRPOConfig)
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=lambda: DataSpec(split="train"))
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    publish: PublishSpec = Field(default_factory=PublishSpec)
    overlap: OverlapSpec = Field(default_factory=OverlapSpec, description="Rollouts overlapping the update.")
    eval: TrainEvalSpec | None = Field(default_factory=TrainEvalSpec, description="None disables evaluation.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    distributed: DistributedSpec = Field(
        default_factory=DistributedSpec, description="Ranks that train the job (crucible_shared.distributed)."
    )
    seed: Seed = Field(0, description="Seeds sampling, shuffling and initialisation.")
    max_attempts: int | None = _ATTEMPTS

    @model_validator(mode="before")
    @classmethod
    def _group_size_moved(cls, data: Any) -> Any:
        return group_size_from_rollout(data)  # jobs/compat.py

    @model_validator(mode="after")
    def _check_overlap(self) -> TrainJob:
        check_overlap(self.overlap, self.method, self.publish, GROUP_METHODS)  # jobs/overlap.py
        return self

    @model_validator(mode="after")
    def _check_early_update(self) -> TrainJob:
        if self.optim.early_update is True and (why := early_update_blocker(self)):
            raise invalid("optim.early_update", f"{why}; set it to auto or false")
        return self

    @model_validator(mode="after")
    def _check_compile(self) -> TrainJob:
        """Compiled passes are built for one process: DDP and FSDP wrap the model they would trace."""
        if self.optim.compile and self.distributed.train_gpus > 1:
            raise invalid(
                "optim.compile",
                f"compiled passes run in one process for now (distributed.train_gpus is "
                f"{self.distributed.train_gpus}); set optim.compile to false or train_gpus to 1",
            )
        return self

    @model_validator(mode="after")
    def _check_games(self) -> TrainJob:
        """A game job makes its own prompts and rewards: the fields that feed problems and their
        rewards would be ignored."""
        if not isinstance(self.method, SpiralConfig):
            return self
        game = self.method.game.name
        if self._changed("data"):
            raise unused("data", f"the {game} game makes its own prompts (data is for evaluation: eval.data)")
        if self.optim._changed("problems_per_step"):
            raise unused("optim.problems_per_step", "a game job plays method.games_per_step games per step")
        for name in ("kind", "length_penalty"):
            if self.reward._changed(name):
                raise unused(f"reward.{name}", f"the {game} game's outcome is the reward")
        if self.reward._changed("time_limit_s") and game != "code_output":
            raise unused("reward.time_limit_s", f"the {game} game runs no programs")
        return self

    @model_validator(mode="after")
    def _check_offline(self) -> TrainJob:
        """SFT and DPO train on a file: the sampling, reward and publishing sections are not read."""
        method = self.method
        if not isinstance(method, SFTConfig | DPOConfig):
            return self
        if not method.path:
            rows = "prompt / completion" if method.name == "sft" else "prompt / chosen / rejected"
            raise invalid(
                "method.path", f"{method.name} trains on a JSONL file of {rows} rows; give its path"
            )
        offline = f"{method.name} trains offline on method.path"
        for name, reason in (
            ("data", f"{offline}, not on tasks (eval.data picks the evaluation tasks)"),
            ("rollout", f"{offline}: nothing is sampled"),
            ("reward", f"{offline}: nothing is executed"),
            ("publish", "the adapter is published once, when training ends"),
            ("distributed", f"{offline} in one process (TRL)"),
        ):
            if self._changed(name):
                raise unused(name, reason)
        check_offline_optim(self.optim, method.name)
        if self.eval is not None and self.eval._changed("every"):
            raise unused("eval.every", f"{method.name} is evaluated before and after training only")
        if self.logging._changed("samples_every"):
            raise unused("logging.samples_every", f"{offline}: no samples to show")
        return self


def early_update_blocker(job: TrainJob) -> str | None:
    """Why `job`'s update cannot start on the groups already scored (`optim.early_update`), or None.

    It can when each group's advantages need only that group's rewards, every scored sample
    counts in the loss's normaliser (known once generation ends), and the step is one pass of one
    optimizer step in one process on rollouts of the version it updates."""
    method = job.method
    if not isinstance(method, GRPOConfig):
        return f"method {method.name} is not GRPO, whose groups' advantages need only their own rewards"
    if method.filter.mode == "dynamic":
        return "method.filter.mode is dynamic: which groups train is known only once all are scored"
    if method.scale == "batch":
        return "method.scale is batch: every advantage needs the whole batch's rewards"
    if method.num_iterations > 1:
        return f"method.num_iterations is {method.num_iterations}: later passes need the whole batch"
    if method.kl_beta > 0:
        return "method.kl_beta is above 0: samples of zero advantage train too"
    if job.optim.grad_accum is not None:
        return "optim.grad_accum is set: a step of several optimizer steps needs the whole batch"
    if job.distributed.train_gpus > 1:
        return f"distributed.train_gpus is {job.distributed.train_gpus}: the ranks share the whole batch"
    if job.overlap.max_staleness:
        return "overlap.max_staleness is above 0: the update already runs beside the next rollouts"
    return None
