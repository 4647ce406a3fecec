"""Job specs: what a user submits (`POST /v1/jobs`, `crucible train --config`, `crucible pipeline`).

A train job is a method config (online: GRPO, SRRL, REINFORCE, PPO, SPIRAL self-play games;
offline with TRL: SFT, DPO on a JSONL file) plus model, data, rollout, reward, optimisation, publishing, evaluation, checkpoint
and logging sections. A pipeline job is the offline learning pipeline (baseline -> candidates ->
execution -> datasets -> SFT/DPO -> merge -> evaluation -> analysis), see `PipelineJob`. Every field has a
default, bounds and a one-line description; cross-field rules live in validators, so a bad
spec fails at submission with the field named, not minutes into a run. A field that would
have no effect in its context (a sampling setting the method doesn't read, pass@k of a greedy
evaluation) is refused rather than silently ignored. Floats must be finite. Pure pydantic: the
gateway validates specs without torch.

The package by concern: `base` (what every section shares), `data` (data and model), `sections`
(rollout, reward, optimisation, publishing, checkpoints, logging), `methods` (online RL configs),
`games` (SPIRAL), `offline` (SFT, DPO), `overlap` (rollouts overlapping the update), `evaluation`, `train` (the train job), `pipeline`,
`spec` (the union of jobs and the paths they name) and `compat` (older spec forms, read as today's).
Facts about a method (does it sample groups, its samples per step) are class attributes of its
config. Everything is importable from here.
"""

from crucible_shared.jobs.base import (
    MAX_SEED,
    MAX_STEPS,
    Seed,
    invalid,
    unused,
)
from crucible_shared.jobs.data import (
    SPLITS,
    Dataset,
    DataSpec,
    ModelSpec,
    Split,
)
from crucible_shared.jobs.evaluation import (
    EvalJob,
    EvalSampling,
    EvalSpec,
    TrainEvalSpec,
)
from crucible_shared.jobs.games import (
    ArenaSpec,
    CodeOutputGame,
    Game,
    Opponent,
    SpiralConfig,
    TicTacToeGame,
)
from crucible_shared.jobs.methods import (
    ClippedMethod,
    GroupFilter,
    GRPOConfig,
    Loss,
    PPOConfig,
    ReinforceConfig,
    SRRLConfig,
)
from crucible_shared.jobs.offline import (
    DPOConfig,
    DPOLoss,
    OfflineMethod,
    SFTConfig,
    check_offline_optim,
)
from crucible_shared.jobs.overlap import OverlapSpec
from crucible_shared.jobs.pipeline import (
    ROUND_STAGES,
    STAGES,
    AnnotateSpec,
    BuildSpec,
    GenerateSpec,
    MergeSpec,
    PipelineJob,
    Stage,
)
from crucible_shared.jobs.sections import (
    CheckpointSpec,
    LoggingSpec,
    OptimSpec,
    PublishSpec,
    RewardSpec,
    RolloutSpec,
)
from crucible_shared.jobs.spec import (
    JobSpec,
    RootKind,
    job_paths,
    looks_like_path,
)
from crucible_shared.jobs.train import (
    GROUP_METHODS,
    METHOD_CONFIGS,
    OFFLINE_METHODS,
    Method,
    TrainJob,
    early_update_blocker,
)

__all__ = [
    "GROUP_METHODS",
    "MAX_SEED",
    "MAX_STEPS",
    "METHOD_CONFIGS",
    "OFFLINE_METHODS",
    "ROUND_STAGES",
    "SPLITS",
    "STAGES",
    "AnnotateSpec",
    "ArenaSpec",
    "BuildSpec",
    "CheckpointSpec",
    "ClippedMethod",
    "CodeOutputGame",
    "DPOConfig",
    "DPOLoss",
    "DataSpec",
    "Dataset",
    "EvalJob",
    "EvalSampling",
    "EvalSpec",
    "GRPOConfig",
    "Game",
    "GenerateSpec",
    "GroupFilter",
    "JobSpec",
    "LoggingSpec",
    "Loss",
    "MergeSpec",
    "Method",
    "ModelSpec",
    "OfflineMethod",
    "Opponent",
    "OptimSpec",
    "OverlapSpec",
    "PPOConfig",
    "PipelineJob",
    "PublishSpec",
    "ReinforceConfig",
    "RewardSpec",
    "RolloutSpec",
    "RootKind",
    "SFTConfig",
    "SRRLConfig",
    "Seed",
    "SpiralConfig",
    "Split",
    "Stage",
    "TicTacToeGame",
    "TrainEvalSpec",
    "TrainJob",
    "check_offline_optim",
    "early_update_blocker",
    "invalid",
    "job_paths",
    "looks_like_path",
    "unused",
]
