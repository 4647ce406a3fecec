"""The offline learning pipeline job and its stages' sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from crucible_shared.jobs.base import _ATTEMPTS, Seed, _Spec, invalid, unused
from crucible_shared.jobs.data import DataSpec, ModelSpec
from crucible_shared.jobs.evaluation import EvalSpec
from crucible_shared.jobs.offline import OfflineMethod, SFTConfig, check_offline_optim
from crucible_shared.jobs.sections import CheckpointSpec, LoggingSpec, OptimSpec, run_limits
from crucible_shared.lifecycle import JobKind
from crucible_shared.sandbox import Limits
from crucible_shared.text import Label

Stage = Literal["baseline", "generate", "annotate", "build", "train", "merge", "evaluate", "analyze"]
STAGES: tuple[Stage, ...] = (
    "baseline",
    "generate",
    "annotate",
    "build",
    "train",
    "merge",
    "evaluate",
    "analyze",
)
ROUND_STAGES: tuple[Stage, ...] = ("generate", "annotate", "build", "train")


class GenerateSpec(_Spec):
    """Stage `generate`: K candidates per train problem, sampled through the generator pool."""

    k: int = Field(8, ge=1, le=1024, description="Candidates per problem.")
    temperature: float = Field(1.0, gt=0, le=5, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_tokens: int = Field(256, ge=1, le=8192, description="Most tokens per candidate.")
    concurrency: int = Field(
        64, ge=1, le=4096, description="Generation requests (one per problem) in flight."
    )


class AnnotateSpec(_Spec):
    """Stage `annotate`: every candidate through the sandbox."""

    time_limit_s: float = Field(5.0, gt=0, le=60, description="Wall-clock limit of one candidate's run.")
    retries: int = Field(
        3,
        ge=0,
        le=20,
        description="Further attempts for runs the sandbox could not execute (infrastructure errors are "
        "retried, never counted as failures; still failing after them, the stage fails).",
    )
    batch: int = Field(256, ge=1, le=4096, description="Runs per sandbox batch call.")

    def limits(self) -> Limits:
        """The sandbox limits of one candidate's run (as `RewardSpec.limits`)."""
        return run_limits(self.time_limit_s)


class BuildSpec(_Spec):
    """Stage `build`: the SFT and DPO datasets from the annotated candidates.

    `nbest.jsonl`: up to `n_best` passing candidates per problem, duplicates (the same program
    after normalising whitespace and comments) dropped, shortest first (fewest completion tokens)
    or in sampling order. `pairs.jsonl`: up to `max_pairs` (chosen, rejected) pairs per problem;
    the rejected candidate always fails; the chosen one passes every test (`pass_fail`) or passes
    a larger fraction of them (`more_tests`), by at least `min_margin`.
    """

    n_best: int = Field(4, ge=1, le=1024, description="Most passing candidates per problem in nbest.jsonl.")
    order: Literal["shortest", "first"] = Field(
        "shortest", description="Which passing candidates come first: fewest tokens, or sampling order."
    )
    completion: Literal["raw", "code"] = Field(
        "raw",
        description="Train on the sampled answer as it is, or on its program alone (a ```python block "
        "for chat models).",
    )
    pairing: Literal["pass_fail", "more_tests"] = Field(
        "pass_fail", description="Chosen passes every test, or passes a larger fraction than rejected."
    )
    min_margin: float = Field(
        0.0, ge=0, le=1, description="Least gap in the fraction of tests passed, chosen minus rejected."
    )
    max_pairs: int = Field(4, ge=1, le=1024, description="Most pairs per problem in pairs.jsonl.")


class MergeSpec(_Spec):
    """Stage `merge`: the final adapter folded into the base weights (PEFT `merge_and_unload`)."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Dtype of the saved weights; default: the base checkpoint's."
    )


class PipelineJob(_Spec):
    """The offline learning pipeline: sample candidates, run them, keep the good ones, train on
    them with SFT or DPO (TRL), merge, evaluate, analyse (see docs/pipeline.md).

    Stages run in pipeline order; `stages` picks a subset. Each reads the artifacts of earlier
    stages from the run dir and is skipped when its outputs exist and its inputs (files and the
    spec sections it reads) hash as when it ran. With `rounds: N` the stages generate -> annotate ->
    build -> train repeat, each round sampling from the previous round's adapter.
    """

    kind: Literal[JobKind.pipeline] = JobKind.pipeline
    name: Label | None = Field(None, max_length=200, description="Label shown in listings (printable text).")
    stages: list[Stage] = Field(
        default_factory=lambda: list(STAGES),
        min_length=1,
        max_length=len(STAGES),
        description="Stages to run.",
    )
    rounds: int = Field(1, ge=1, le=64, description="Rounds of generate -> annotate -> build -> train.")
    reuse: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        description="Start from the run dir of this earlier pipeline job (copied, files hard-linked): "
        "its stages whose inputs are unchanged are skipped.",
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="The starting policy and its LoRA.")
    data: DataSpec = Field(
        default_factory=lambda: DataSpec(split="train"),
        description="The problems candidates are sampled for.",
    )
    generate: GenerateSpec = Field(default_factory=GenerateSpec)
    annotate: AnnotateSpec = Field(default_factory=AnnotateSpec)
    build: BuildSpec = Field(default_factory=BuildSpec)
    train: OfflineMethod = Field(default_factory=SFTConfig, description="sft (on nbest) or dpo (on pairs).")
    optim: OptimSpec = Field(default_factory=lambda: OptimSpec(lr=1e-4), description="TRL's optimiser.")
    eval: EvalSpec = Field(
        default_factory=EvalSpec, description="Stages baseline and evaluate (default: MBPP test, greedy)."
    )
    merge: MergeSpec = Field(default_factory=MergeSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    seed: Seed = Field(0, description="Seeds sampling, data order and initialisation.")
    max_attempts: int | None = _ATTEMPTS

    @model_validator(mode="after")
    def _check(self) -> PipelineJob:
        if len(set(self.stages)) != len(self.stages):
            raise invalid("stages", "each stage at most once")
        # Stages run in pipeline order whatever order they are listed in.
        self.stages = [s for s in STAGES if s in self.stages]
        if self.train.path:
            raise unused("train.path", "the pipeline trains on the nbest.jsonl / pairs.jsonl it builds")
        check_offline_optim(self.optim, self.train.name)
        if self.logging._changed("samples_every"):
            raise unused("logging.samples_every", "the pipeline logs every candidate (candidates.jsonl)")
        # Sections of stages not in `stages` are not refused: `stages` picks what runs now out of
        # one pipeline spec (like a --only flag), and those sections still describe the run dir's
        # other stages (their records are checked against them).
        return self
