"""Job specs: what a user submits (`POST /v1/jobs`, `crucible train --config`).

A train job is a method config (GRPO, SRRL, REINFORCE, PPO) plus model, data, rollout, reward,
optimisation, publishing, evaluation, checkpoint and logging sections. Every field has a
default, bounds and a one-line description; cross-field rules live in validators, so a bad
spec fails at submission with the field named, not minutes into a run. Pure pydantic: the
gateway validates specs without torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- data and model ------------------------------------------------------------------------------


Dataset = Literal["mbpp", "humaneval", "stdio", "jsonl"]
Split = Literal["prompt", "test", "validation", "train", "all"]


class DataSpec(_Spec):
    """A dataset and the subset of it to use (JSON-serialisable: it travels inside job specs)."""

    dataset: Dataset = Field(default="mbpp", description="Which adapter reads the tasks.")
    split: Split | None = Field(
        default=None,
        description="MBPP split by task id (prompt 1-10, test 11-510, validation 511-600, train 601-974); "
        "default `test`, or `all` when `ids` / `id_range` pick the tasks. Other datasets: `all` only.",
    )
    path: str | None = Field(
        default=None, description="JSONL file (required for stdio and jsonl; overrides MBPP/HumanEval data)."
    )
    ids: list[int | str] | None = Field(
        default=None, description="Task ids to keep, in this order: 11, `MBPP/11`, `HumanEval/3`, `my-task`."
    )
    id_range: tuple[int, int] | None = Field(
        default=None, description="Inclusive range of numeric task ids (MBPP 601-630, HumanEval 0-19)."
    )
    limit: int | None = Field(default=None, ge=1, description="Keep at most this many tasks.")
    shuffle: bool = Field(default=False, description="Shuffle (with `seed`) before applying `limit`.")
    seed: int = Field(default=0, description="Seed of the shuffle.")
    challenge_tests: bool = Field(default=True, description="MBPP: add `challenge_test_list` to the tests.")
    max_cases: int | None = Field(
        default=None, ge=1, description="stdio: keep at most this many cases per task."
    )

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if self.dataset in ("stdio", "jsonl") and not self.path:
            raise ValueError(f"path: a {self.dataset} dataset needs the path of its JSONL file")
        if self.dataset != "mbpp" and self.split not in (None, "all"):
            raise ValueError(f"split: {self.dataset} has no split {self.split!r} (only MBPP has splits)")
        if self.ids is not None and self.id_range is not None:
            raise ValueError("ids and id_range: give one of them, not both")
        if self.ids is not None and not self.ids:
            raise ValueError("ids: empty list")
        if self.id_range is not None and self.id_range[0] > self.id_range[1]:
            raise ValueError(f"id_range: start {self.id_range[0]} is after end {self.id_range[1]}")
        return self

    @property
    def effective_split(self) -> str:
        if self.split is not None:
            return self.split
        if self.dataset == "mbpp" and self.ids is None and self.id_range is None:
            return "test"
        return "all"

    def describe(self) -> str:
        """A short human label: `mbpp/test[first 30]`."""
        parts = [f"{self.dataset}/{self.effective_split}"]
        if self.ids is not None:
            parts.append(f"ids={len(self.ids)}")
        if self.id_range is not None:
            parts.append(f"ids {self.id_range[0]}-{self.id_range[1]}")
        if self.limit is not None:
            parts.append(f"{'random' if self.shuffle else 'first'} {self.limit}")
        elif self.shuffle:
            parts.append("shuffled")
        return " ".join(parts)


class ModelSpec(_Spec):
    """Base model and the LoRA adapter trained on it."""

    base: str = Field("smollm2-135m-instruct", description="Built-in name, HF model id or local path.")
    chat: bool = Field(
        True, description="Prompt with the chat template (instruct models) or plain completion."
    )
    lora_r: int = Field(16, ge=1, le=512, description="LoRA rank.")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Modules that get LoRA."
    )
    init_adapter: str | None = Field(None, description="Start from this saved adapter (PEFT directory).")
    dtype: str | None = Field(None, description="float32 / bfloat16; default: bf16 on CUDA, fp32 on CPU.")
    device: str | None = Field(None, description="cpu / cuda / cuda:N; default: CUDA when present.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the update.")


# --- rollout, reward, optimisation ---------------------------------------------------------------


class RolloutSpec(_Spec):
    """How completions are sampled from the generator."""

    group_size: int = Field(8, ge=1, le=256, description="Samples per prompt (GRPO's G).")
    temperature: float = Field(1.0, ge=0, le=5, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_tokens: int = Field(256, ge=1, le=8192, description="Max new tokens per completion.")
    stop: list[str] | None = Field(None, description="Stop sequences.")


class RewardSpec(_Spec):
    """Reward = a pure function of the sandbox result, minus the length penalty."""

    kind: Literal["all_pass", "fraction", "graded"] = Field(
        "fraction", description="all_pass 1/0; fraction of tests passed; graded execution reward."
    )
    length_penalty: float = Field(0.0, ge=0, description="alpha in r - alpha * generated_tokens / 100.")
    time_limit_s: float = Field(
        5.0,
        gt=0,
        le=60,
        description="Wall-clock limit of one program's run (a step waits for its slowest program).",
    )


class OptimSpec(_Spec):
    """Optimisation of the LoRA parameters (AdamW)."""

    lr: float = Field(1e-5, gt=0, le=1, description="Learning rate.")
    steps: int = Field(100, ge=1, description="Policy updates (training steps).")
    problems_per_step: int = Field(8, ge=1, description="Prompts sampled per step.")
    micro_batch: int = Field(16, ge=1, description="Sequences per forward/backward pass.")
    grad_accum: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step; default: the whole batch."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping (None disables it).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up.")


# --- methods -------------------------------------------------------------------------------------


class GRPOConfig(_Spec):
    """Group Relative Policy Optimisation."""

    name: Literal["grpo"] = "grpo"
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's / batch's std, or not."
    )
    loss: Literal["sequence", "token", "dr_grpo"] = Field(
        "token",
        description="Aggregation: mean per sequence, mean over all tokens (DAPO), or sum / max_tokens (Dr. GRPO).",
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range (low side, and high side unless set)."
    )
    clip_eps_high: float | None = Field(None, gt=0, lt=1, description="Clip-higher (DAPO) upper range.")
    kl_beta: float = Field(0.0, ge=0, description="KL penalty to the reference (the base without adapter).")
    num_iterations: int = Field(1, ge=1, le=16, description="mu: updates per batch of rollouts.")
    difficulty_filter: bool = Field(
        False,
        description="Keep only problems with 0 < pass rate < 1 in a quick pre-sampling pass before training.",
    )
    filter_samples: int = Field(4, ge=2, le=64, description="Samples per problem in that pass.")


class SRRLConfig(_Spec):
    """Self-refined RL: first attempts (c1), refinements of the failed ones (c2), trained together."""

    name: Literal["srrl"] = "srrl"
    c1: int = Field(2, ge=1, le=64, description="First attempts per problem.")
    c2: int = Field(4, ge=1, le=64, description="Refinements per failed first attempt.")
    c2_temperature: float = Field(0.3, ge=0, le=5, description="Sampling temperature of refinements.")
    budget: int = Field(10, ge=2, description="Max samples per problem (c1 + all c2), matched to GRPO's G.")
    refine_max_tokens: int | None = Field(
        None, ge=1, description="Max new tokens of a refinement (default: rollout's)."
    )
    scale: Literal["group", "none"] = Field(
        "group", description="Normalise advantages per problem by std, or only centre."
    )
    loss: Literal["sequence", "token", "dr_grpo"] = "token"
    clip_eps: float = Field(0.2, gt=0, lt=1)
    num_iterations: int = Field(1, ge=1, le=16)
    kl_beta: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> SRRLConfig:
        if self.c1 >= self.budget:
            raise ValueError("c1 must be smaller than budget so refinements fit in it")
        return self


class ReinforceConfig(_Spec):
    """REINFORCE: loss = -(r - baseline) * log p(completion)."""

    name: Literal["reinforce"] = "reinforce"
    samples: int = Field(1, ge=1, le=64, description="Samples per task.")
    baseline: bool = Field(True, description="Subtract the batch mean reward.")


class PPOConfig(_Spec):
    """PPO-clip over stored rollouts with batch-normalised advantages."""

    name: Literal["ppo"] = "ppo"
    epochs: int = Field(4, ge=1, le=64, description="Passes over each batch of rollouts.")
    clip_eps: float = Field(0.2, gt=0, lt=1)
    samples: int = Field(1, ge=1, le=64, description="Samples per task.")


Method = Annotated[GRPOConfig | SRRLConfig | ReinforceConfig | PPOConfig, Field(discriminator="name")]


# --- publishing, evaluation, checkpoints, logging ------------------------------------------------


class PublishSpec(_Spec):
    """How new adapter versions reach the generator."""

    every: int = Field(1, ge=1, description="Publish after every N updates.")
    staleness_window: int = Field(
        1, ge=0, description="Older versions kept loaded (vLLM --max-loras >= this + 1)."
    )
    stale_check: bool = Field(True, description="Score a probe with trainer and generator after each swap.")
    stale_tolerance: float = Field(0.05, gt=0, description="Max mean |logprob difference| on the probe.")


class EvalSpec(_Spec):
    """Interval and final evaluation on a held-out split."""

    every: int = Field(0, ge=0, description="Evaluate every N steps (0: only before and after).")
    data: DataSpec = Field(default_factory=lambda: DataSpec(split="test", limit=30))
    n: int = Field(1, ge=1, description="Samples per problem.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    max_tokens: int = Field(256, ge=1)
    ks: list[int] = Field(default_factory=lambda: [1], description="pass@k values to report (k <= n).")
    before: bool = Field(True, description="Evaluate the starting policy too.")

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        if any(k > self.n or k < 1 for k in self.ks):
            raise ValueError(f"every k in ks must be between 1 and n={self.n}")
        return self


class CheckpointSpec(_Spec):
    every: int = Field(10, ge=1, description="Save adapter + optimizer + step + RNG every N steps.")


class LoggingSpec(_Spec):
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="Weights & Biases mode."
    )
    wandb_project: str = "crucible"
    run_name: str | None = None


class TrainJob(_Spec):
    """A training job."""

    kind: Literal["train"] = "train"
    name: str | None = Field(None, max_length=200, description="Label shown in listings.")
    method: Method = Field(default_factory=GRPOConfig)
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=lambda: DataSpec(split="train"))
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    publish: PublishSpec = Field(default_factory=PublishSpec)
    eval: EvalSpec | None = Field(default_factory=EvalSpec, description="None disables evaluation.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    seed: int = Field(0, description="Seeds sampling, shuffling and initialisation.")

    @model_validator(mode="after")
    def _check(self) -> TrainJob:
        if isinstance(self.method, GRPOConfig) and self.rollout.group_size < 2:
            raise ValueError(
                "rollout.group_size must be at least 2 for GRPO (advantages are relative to the group)"
            )
        return self


class EvalJob(_Spec):
    """An evaluation job: a model (optionally with an adapter) on a dataset."""

    kind: Literal["eval"] = "eval"
    name: str | None = Field(None, max_length=200)
    model: ModelSpec = Field(default_factory=ModelSpec)
    adapter: str | None = Field(None, description="Evaluate this adapter (path) on top of the base model.")
    data: DataSpec = Field(default_factory=lambda: DataSpec(split="test"))
    n: int = Field(1, ge=1, le=1000)
    temperature: float = Field(0.0, ge=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, ge=1, le=8192)
    ks: list[int] = Field(default_factory=lambda: [1])
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> EvalJob:
        if any(k > self.n or k < 1 for k in self.ks):
            raise ValueError(f"every k in ks must be between 1 and n={self.n}")
        return self


JobSpec = Annotated[TrainJob | EvalJob, Field(discriminator="kind")]
