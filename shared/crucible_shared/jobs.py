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
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from crucible_shared.distributed import DistributedSpec

MAX_SEED = 2**63 - 1
MAX_STEPS = 1_000_000
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def _changed(self, name: str) -> bool:
        """Whether `name` differs from its default. (Not "was given": a spec dumped with its
        defaults and parsed again, as every queued job is, must still be valid.)"""
        field = type(self).model_fields[name]
        return getattr(self, name) != field.get_default(call_default_factory=True)


def unused(field: str, reason: str) -> PydanticCustomError:
    """The error for a field that would be silently ignored; `field` is the dotted path from the
    model being validated (the gateway reports it as the error's field)."""
    return PydanticCustomError("unused_field", "{field}: {reason}", {"field": field, "reason": reason})


def invalid(field: str, reason: str) -> PydanticCustomError:
    """A cross-field error that names its field as `unused` does (for the gateway's envelope)."""
    return PydanticCustomError("value_error", "{field}: {reason}", {"field": field, "reason": reason})


# --- data and model ------------------------------------------------------------------------------


Dataset = Literal["mbpp", "humaneval", "stdio", "jsonl"]
Split = Literal["prompt", "test", "validation", "train", "all"]
# MBPP's standard splits by task id; HumanEval's seeded 131/33 train/test split (docs/evaluation.md).
SPLITS: dict[str, tuple[str, ...]] = {
    "mbpp": ("prompt", "test", "validation", "train", "all"),
    "humaneval": ("train", "test", "all"),
}


class DataSpec(_Spec):
    """A dataset and the subset of it to use (JSON-serialisable: it travels inside job specs)."""

    dataset: Dataset = Field(default="mbpp", description="Which adapter reads the tasks.")
    split: Split | None = Field(
        default=None,
        description="MBPP split by task id (prompt 1-10, test 11-510, validation 511-600, train 601-974); "
        "default `test`, or `all` when `ids` / `id_range` pick the tasks. HumanEval: `train` (131 tasks) "
        "or `test` (33), a seeded split; default `all`. Other datasets: `all` only.",
    )
    path: str | None = Field(
        default=None,
        max_length=4096,
        description="JSONL file (required for stdio and jsonl; overrides MBPP/HumanEval data). "
        "Must lie inside the data roots (CRUCIBLE_DATA_ROOTS).",
    )
    ids: list[int | str] | None = Field(
        default=None,
        max_length=100_000,
        description="Task ids to keep, in this order: 11, `MBPP/11`, `HumanEval/3`, `my-task`.",
    )
    id_range: tuple[Annotated[int, Field(ge=0, le=10**9)], Annotated[int, Field(ge=0, le=10**9)]] | None = (
        Field(default=None, description="Inclusive range of numeric task ids (MBPP 601-630, HumanEval 0-19).")
    )
    limit: int | None = Field(default=None, ge=1, le=10**7, description="Keep at most this many tasks.")
    shuffle: bool = Field(default=False, description="Shuffle (with `seed`) before applying `limit`.")
    seed: Seed = Field(default=0, description="Seed of the shuffle.")
    challenge_tests: bool = Field(default=True, description="MBPP: add `challenge_test_list` to the tests.")
    max_cases: int | None = Field(
        default=None, ge=1, le=10_000, description="stdio: keep at most this many cases per task."
    )

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if self.dataset in ("stdio", "jsonl") and not self.path:
            raise ValueError(f"path: a {self.dataset} dataset needs the path of its JSONL file")
        allowed = SPLITS.get(self.dataset, ("all",))
        if self.split not in (None, *allowed):
            raise ValueError(
                f"split: {self.dataset} has no split {self.split!r} (it has: {', '.join(allowed)})"
            )
        if self.ids is not None and self.id_range is not None:
            raise ValueError("ids and id_range: give one of them, not both")
        if self.ids is not None and not self.ids:
            raise ValueError("ids: empty list")
        if self.id_range is not None and self.id_range[0] > self.id_range[1]:
            raise ValueError(f"id_range: start {self.id_range[0]} is after end {self.id_range[1]}")
        if self._changed("challenge_tests") and self.dataset != "mbpp":
            raise unused("challenge_tests", f"only MBPP has challenge tests, not {self.dataset}")
        if self.max_cases is not None and self.dataset != "stdio":
            raise unused("max_cases", f"only stdio tasks have cases, not {self.dataset}")
        if self._changed("seed") and not self.shuffle:
            raise unused("seed", "it seeds the shuffle; set shuffle: true or drop it")
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

    base: str = Field(
        "smollm2-135m-instruct",
        min_length=1,
        max_length=4096,
        description="Built-in name, HF model id, or a local path (absolute or ./relative) inside the "
        "model roots (CRUCIBLE_MODEL_ROOTS).",
    )
    chat: bool = Field(
        True, description="Prompt with the chat template (instruct models) or plain completion."
    )
    lora_r: int = Field(16, ge=1, le=512, description="LoRA rank.")
    lora_alpha: float = Field(32.0, gt=0, le=1e6, description="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=200)]] | Literal["all-linear"] = Field(
        "all-linear", max_length=64, description="Modules that get LoRA."
    )
    init_adapter: str | None = Field(
        None,
        max_length=4096,
        description="Start from this saved adapter (PEFT directory inside the adapter roots); "
        "its LoRA config replaces lora_*.",
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] | None = Field(
        None, description="Weights' dtype; default: bf16 on CUDA, fp32 on CPU."
    )
    device: str | None = Field(
        None,
        pattern=r"^(cpu|auto|cuda(:\d{1,2})?)$",
        description="cpu / cuda / cuda:N; default: CUDA when present.",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="Trade compute for memory in the update; auto: on when a micro-batch would not fit "
        "in free GPU memory.",
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto",
        description="Attention kernel; auto: sdpa where transformers has it for the family, else eager "
        "(Gemma-2); flash_attention_2 needs the flash-attn package (CUDA).",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.init_adapter:
            for name in ("lora_r", "lora_alpha", "lora_dropout", "target_modules"):
                if self._changed(name):
                    raise unused(name, "model.init_adapter brings its own LoRA config")
        return self


# --- rollout, reward, optimisation ---------------------------------------------------------------


class RolloutSpec(_Spec):
    """How completions are sampled from the generator (how many per prompt is the method's)."""

    temperature: float = Field(1.0, ge=0, le=5, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_tokens: int = Field(256, ge=1, le=8192, description="Max new tokens per completion.")
    stop: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(
        None, max_length=16, description="Stop sequences."
    )


class RewardSpec(_Spec):
    """Reward = a pure function of the sandbox result, minus the length penalty."""

    kind: Literal["all_pass", "fraction", "graded"] = Field(
        "fraction", description="all_pass 1/0; fraction of tests passed; graded execution reward."
    )
    length_penalty: float = Field(
        0.0, ge=0, le=100, description="alpha in r - alpha * generated_tokens / 100."
    )
    time_limit_s: float = Field(
        5.0,
        gt=0,
        le=60,
        description="Wall-clock limit of one program's run (a step waits for its slowest program).",
    )


class OptimSpec(_Spec):
    """Optimisation of the LoRA parameters (AdamW)."""

    @model_validator(mode="after")
    def _check_micro_batch(self) -> OptimSpec:
        if self.micro_batch != "auto" and not 1 <= self.micro_batch <= 4096:
            raise ValueError("micro_batch: between 1 and 4096, or auto")
        return self

    lr: float = Field(1e-5, gt=0, le=1, description="Learning rate.")
    steps: int = Field(100, ge=1, le=MAX_STEPS, description="Policy updates (training steps).")
    problems_per_step: int = Field(8, ge=1, le=4096, description="Prompts sampled per step.")
    micro_batch: int | Literal["auto"] = Field(
        "auto",
        description="Sequences per forward/backward pass (at most 4096); auto: 16 on CPU, from free "
        "memory on a GPU.",
    )
    grad_accum: int | None = Field(
        None, ge=1, le=4096, description="Micro-batches per optimizer step; default: the whole batch."
    )
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, le=1e6, description="Gradient clipping (None disables it)."
    )
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear learning-rate warm-up.")


# --- methods -------------------------------------------------------------------------------------


class GroupFilter(_Spec):
    """Which groups of samples train: all, those of a one-off pre-filter, or dynamic sampling.

    Groups whose rewards are all equal have zero advantage and carry no gradient. `pre`
    samples every problem once before training and keeps those with 0 < pass rate < 1.
    `dynamic` (DAPO's dynamic sampling) drops zero-variance groups during training and samples
    groups of fresh problems until the step has `problems_per_step` informative ones, drawing
    at most `max_draw_factor` times that many groups per step.
    """

    mode: Literal["none", "pre", "dynamic"] = Field("none", description="none | pre | dynamic.")
    pre_samples: int = Field(4, ge=2, le=64, description="pre: samples per problem in the pre-filter pass.")
    max_draw_factor: float = Field(
        3.0, ge=1, le=32, description="dynamic: most groups sampled per step, as a multiple of the quota."
    )

    @model_validator(mode="after")
    def _check(self) -> GroupFilter:
        if self._changed("pre_samples") and self.mode != "pre":
            raise unused("pre_samples", f"only the pre-filter samples ahead (mode is {self.mode})")
        if self._changed("max_draw_factor") and self.mode != "dynamic":
            raise unused("max_draw_factor", f"only dynamic sampling draws more groups (mode is {self.mode})")
        return self


def _legacy_filter(data: Any) -> Any:
    """Specs written before `filter` existed: `difficulty_filter: true` (+ `filter_samples`) is the
    pre-filter."""
    if isinstance(data, dict) and ("difficulty_filter" in data or "filter_samples" in data):
        data = dict(data)
        on, samples = data.pop("difficulty_filter", False), data.pop("filter_samples", None)
        if "filter" in data and (on or samples is not None):
            raise ValueError("difficulty_filter: give `filter` alone (difficulty_filter is its old form)")
        if on:
            data["filter"] = {"mode": "pre", **({"pre_samples": samples} if samples is not None else {})}
        elif samples is not None:
            raise unused("filter_samples", "the difficulty filter is off")
    return data


class _ClippedMethod(_Spec):
    """Shared checks of the methods with a clipped ratio."""

    @model_validator(mode="after")
    def _check_clip(self) -> _ClippedMethod:
        if getattr(self, "num_iterations", 1) == 1:
            for name in ("clip_eps", "clip_eps_high"):
                if name in type(self).model_fields and self._changed(name):
                    raise unused(
                        name,
                        "with num_iterations 1 the policy is updated once per batch, its ratio is 1 "
                        "and nothing is clipped; raise num_iterations or drop it",
                    )
        return self


class GRPOConfig(_ClippedMethod):
    """Group Relative Policy Optimisation."""

    name: Literal["grpo"] = "grpo"
    group_size: int = Field(8, ge=2, le=256, description="G: samples per prompt.")
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
    kl_beta: float = Field(
        0.0, ge=0, le=100, description="KL penalty to the reference (the starting policy)."
    )
    num_iterations: int = Field(1, ge=1, le=16, description="mu: updates per batch of rollouts.")
    filter: GroupFilter = Field(default_factory=GroupFilter, description="Which groups train.")

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        return _legacy_filter(data)


class SRRLConfig(_ClippedMethod):
    """Self-refined RL: first attempts (c1), refinements of the failed ones (c2), trained together."""

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
    loss: Literal["sequence", "token", "dr_grpo"] = "token"
    clip_eps: float = Field(0.2, gt=0, lt=1)
    num_iterations: int = Field(1, ge=1, le=16)
    kl_beta: float = Field(0.0, ge=0, le=100)
    filter: GroupFilter = Field(
        default_factory=GroupFilter, description="Which problems train (a group is c1 + c2 of one problem)."
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        return _legacy_filter(data)

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
    ratio: Literal["token", "sequence"] = Field(
        "token",
        description="Importance ratio per token, or one per completion: exp(sum logp_new - sum logp_old).",
    )
    samples: int = Field(1, ge=1, le=64, description="Samples per task.")


# --- self-play games (SPIRAL) ----------------------------------------------------------------------


class CodeOutputGame(_Spec):
    """The code-output game: the writer writes a short program, the predictor says what it prints.

    The sandbox runs the program (`determinism_runs` times); the predictor's answer is compared
    with its output after whitespace normalisation. Right: predictor +1, writer -1; wrong: the
    reverse. A program that is missing, too long, fails, times out, prints nothing, prints more
    than `max_output_chars` or prints differently between runs scores the writer -1 and the
    predictor does not play.
    """

    name: Literal["code_output"] = "code_output"
    roles: ClassVar[tuple[str, ...]] = ("writer", "predictor")
    max_program_chars: int = Field(
        600, ge=20, le=20_000, description="A longer program is invalid (the writer loses)."
    )
    max_output_chars: int = Field(
        200, ge=1, le=10_000, description="A program that prints more is invalid (the writer loses)."
    )
    stdin: bool = Field(
        False,
        description="The writer may give its program an input (a ```stdin block); the predictor sees it.",
    )
    determinism_runs: int = Field(
        2,
        ge=1,
        le=4,
        description="Runs of each program; outputs that differ make it invalid (a random program is no puzzle).",
    )


class TicTacToeGame(_Spec):
    """Tic-tac-toe (SPIRAL's first game): X moves first; a missing or illegal move loses the game."""

    name: Literal["tictactoe"] = "tictactoe"
    roles: ClassVar[tuple[str, ...]] = ("x", "o")
    random_players: ClassVar[bool] = True


Game = Annotated[CodeOutputGame | TicTacToeGame, Field(discriminator="name")]


class Opponent(_Spec):
    """Who plays the roles the learning policy does not: itself (self-play), a fixed model, or a
    random legal mover."""

    kind: Literal["self", "model", "random"] = Field(
        "self",
        description="self: the learning policy (self-play); model: a fixed model; random: random legal moves.",
    )
    model: str = Field(
        "base",
        min_length=1,
        max_length=200,
        description="kind model: `base` (the frozen base model of the job) or any model or adapter name the "
        "generator serves.",
    )

    @model_validator(mode="after")
    def _check(self) -> Opponent:
        if self._changed("model") and self.kind != "model":
            raise unused("model", f"only a model opponent names a model (kind is {self.kind})")
        return self

    @property
    def label(self) -> str:
        """Its name in metrics: `self`, `random`, `base` or the model name."""
        return self.model if self.kind == "model" else self.kind


def _random_players(game: Any, opponent: Opponent, field: str) -> None:
    if opponent.kind == "random" and not getattr(game, "random_players", False):
        raise invalid(field, f"{game.name} has no random player (its moves are free text)")


class ArenaSpec(_Spec):
    """Games against fixed opponents that measure the policy while it trains (never trained on).

    They run with the step's training games (same batches), at steps 1, 1 + every, ...: each
    measures the policy that plays that step, before its update.
    """

    every: int = Field(0, ge=0, le=MAX_STEPS, description="Play them every N steps (0: never).")
    games: int = Field(
        16, ge=1, le=4096, description="Games per opponent, the learner's roles taken in turn."
    )
    opponents: list[Opponent] = Field(
        default_factory=lambda: [Opponent(kind="model")],
        min_length=1,
        max_length=8,
        description="Fixed opponents (model or random; not self).",
    )

    @model_validator(mode="after")
    def _check(self) -> ArenaSpec:
        if self.every == 0:
            for name in ("games", "opponents"):
                if self._changed(name):
                    raise unused(name, "arena.every is 0 (no arena games); set every > 0")
        for i, opponent in enumerate(self.opponents):
            if opponent.kind == "self":
                raise invalid(f"opponents.{i}.kind", "the arena measures against fixed opponents, not self")
        labels = [o.label for o in self.opponents]
        if len(set(labels)) != len(labels):
            raise invalid("opponents", f"each opponent once (got {labels})")
        return self


class SpiralConfig(_ClippedMethod):
    """SPIRAL: multi-turn, multi-role games played by the policy against itself (its role given in
    the prompt) or against a fixed opponent, trained on its own turns with role-conditioned
    advantages: return minus an EMA baseline per (game, role)."""

    name: Literal["spiral"] = "spiral"
    game: Game = Field(default_factory=CodeOutputGame, description="The game and its options.")
    games_per_step: int = Field(16, ge=1, le=4096, description="Games played (and trained on) per step.")
    opponent: Opponent = Field(default_factory=Opponent, description="Who plays the other roles.")
    learner_roles: list[Annotated[str, Field(min_length=1, max_length=32)]] | None = Field(
        None,
        max_length=8,
        description="Fixed opponent: the roles the learner plays, taken in turn over the games "
        "(default: every role of the game).",
    )
    baseline: Literal["role", "shared", "none"] = Field(
        "role",
        description="role: RAE, an EMA baseline per (game, role); shared: one EMA baseline for every role "
        "(the ablation); none: raw returns.",
    )
    baseline_decay: float = Field(
        0.95, ge=0, lt=1, description="EMA decay of a baseline, per return folded in."
    )
    scale: Literal["none", "role"] = Field(
        "none",
        description="role: divide advantages by the std of the role's returns in the step (GRPO-style).",
    )
    loss: Literal["sequence", "token", "dr_grpo"] = Field(
        "token", description="Loss aggregation (as GRPO's)."
    )
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range.")
    num_iterations: int = Field(1, ge=1, le=16, description="Updates per batch of turns.")
    kl_beta: float = Field(
        0.0, ge=0, le=100, description="KL penalty to the reference (the starting policy)."
    )
    arena: ArenaSpec = Field(
        default_factory=ArenaSpec, description="Measuring games against fixed opponents."
    )

    @model_validator(mode="after")
    def _check(self) -> SpiralConfig:
        roles = type(self.game).roles
        if self._changed("baseline_decay") and self.baseline == "none":
            raise unused("baseline_decay", "baseline is none (no baseline to decay)")
        if self.learner_roles is not None:
            if self.opponent.kind == "self":
                raise unused("learner_roles", "in self-play the learner plays every role")
            for i, role in enumerate(self.learner_roles):
                if role not in roles:
                    raise invalid(
                        f"learner_roles.{i}", f"{self.game.name} has roles {', '.join(roles)}, not {role!r}"
                    )
            if len(set(self.learner_roles)) != len(self.learner_roles):
                raise invalid("learner_roles", "each role once")
        _random_players(self.game, self.opponent, "opponent.kind")
        for i, opponent in enumerate(self.arena.opponents):
            _random_players(self.game, opponent, f"arena.opponents.{i}.kind")
        return self

    @property
    def roles_learned(self) -> tuple[str, ...]:
        """The roles the learner plays."""
        roles = type(self.game).roles
        if self.opponent.kind == "self" or self.learner_roles is None:
            return roles
        return tuple(self.learner_roles)


# --- offline methods (TRL) -----------------------------------------------------------------------

# TRL's DPO loss types (`trl.DPOConfig.loss_type`), and those that read `label_smoothing`.
DPOLoss = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]
_SMOOTHED_LOSSES = frozenset({"exo_pair", "robust", "aot", "aot_unpaired"})
OFFLINE_METHODS = ("sft", "dpo")


class _OfflineMethod(_Spec):
    """What SFT and DPO share: the data file, the training length and the sequence cap."""

    path: str | None = Field(
        None,
        max_length=4096,
        description="JSONL to train on (standalone jobs; a pipeline trains on the data it builds). "
        "Must lie inside the data roots (CRUCIBLE_DATA_ROOTS).",
    )
    epochs: float = Field(1.0, gt=0, le=1000, description="Passes over the data (unless max_steps is set).")
    max_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Optimizer steps; overrides epochs (TRL's max_steps)."
    )
    max_length: int = Field(
        1024,
        ge=16,
        le=65536,
        description="Longest prompt + completion in tokens (longer rows are truncated).",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "linear", description="Learning-rate schedule after optim.warmup_steps."
    )

    @model_validator(mode="after")
    def _check_length(self) -> _OfflineMethod:
        if self.max_steps is not None and self._changed("epochs"):
            raise unused("epochs", "max_steps sets the training length; give one of them")
        return self


class SFTConfig(_OfflineMethod):
    """Supervised fine-tuning (TRL `SFTTrainer`, LoRA): rows `prompt` / `completion`, loss on the
    completion tokens only."""

    name: Literal["sft"] = "sft"


class DPOConfig(_OfflineMethod):
    """Direct preference optimisation (TRL `DPOTrainer`, LoRA): rows `prompt` / `chosen` / `rejected`.
    The reference is the starting policy: the base model, or base + `model.init_adapter`."""

    name: Literal["dpo"] = "dpo"
    beta: float = Field(0.1, gt=0, le=100, description="Strength of the pull to the reference (IPO's tau).")
    loss_type: list[DPOLoss] = Field(
        default_factory=lambda: list[DPOLoss](["sigmoid"]),
        min_length=1,
        max_length=8,
        description="TRL loss type(s); several are summed with loss_weights (e.g. MPO: sigmoid, bco_pair, sft).",
    )
    loss_weights: list[Annotated[float, Field(ge=0, le=1e6)]] | None = Field(
        None, max_length=8, description="Weight of each loss type (default: 1 each)."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Label noise of robust / EXO / AOT losses (TRL's label_smoothing)."
    )

    @model_validator(mode="after")
    def _check(self) -> DPOConfig:
        if len(set(self.loss_type)) != len(self.loss_type):
            raise ValueError("loss_type: each loss type at most once")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights: {len(self.loss_weights)} weights for {len(self.loss_type)} loss types"
            )
        if self.loss_weights is not None and len(self.loss_type) == 1:
            raise unused("loss_weights", "there is one loss type; weights combine several")
        smoothed = _SMOOTHED_LOSSES & set(self.loss_type)
        if self._changed("label_smoothing") and not smoothed:
            raise unused("label_smoothing", f"only the {', '.join(sorted(_SMOOTHED_LOSSES))} losses read it")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0:
            raise ValueError("label_smoothing: the exo_pair loss needs it > 0 (EXO recommends 1e-3)")
        return self


OfflineMethod = Annotated[SFTConfig | DPOConfig, Field(discriminator="name")]
Method = Annotated[
    GRPOConfig | SRRLConfig | ReinforceConfig | PPOConfig | SpiralConfig | SFTConfig | DPOConfig,
    Field(discriminator="name"),
]


# --- publishing, evaluation, checkpoints, logging ------------------------------------------------


class PublishSpec(_Spec):
    """How new adapter versions reach the generator."""

    every: int = Field(1, ge=1, le=MAX_STEPS, description="Publish after every N updates.")
    staleness_window: int = Field(
        1, ge=0, le=64, description="Older versions kept loaded (vLLM --max-loras >= this + 1)."
    )
    stale_check: bool = Field(
        True, description="Score a probe with trainer and generator for each version rollouts sample from."
    )
    stale_tolerance: float = Field(
        0.05, gt=0, le=100, description="Max mean |logprob difference| on the probe."
    )

    @model_validator(mode="after")
    def _check(self) -> PublishSpec:
        if self._changed("stale_tolerance") and not self.stale_check:
            raise unused("stale_tolerance", "stale_check is off")
        return self


class EvalSpec(_Spec):
    """An evaluation: which problems, and how answers are sampled and scored.

    `greedy` decodes one answer per problem (greedy pass@1); `n` samples that many more at
    `temperature` / `top_p` for pass@k (k in `ks`, each at most n).
    """

    data: DataSpec = Field(default_factory=lambda: DataSpec(split="test"))
    greedy: bool = Field(True, description="One greedy answer per problem (greedy pass@1).")
    n: int = Field(0, ge=0, le=1000, description="Sampled answers per problem (0: greedy only).")
    temperature: float = Field(0.8, gt=0, le=5, description="Temperature of the n samples.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus mass of the n samples.")
    max_tokens: int = Field(256, ge=1, le=8192, description="Most tokens per answer.")
    ks: list[Annotated[int, Field(ge=1, le=1000)]] = Field(
        default_factory=lambda: [1], max_length=32, description="pass@k to report (each k <= n)."
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_greedy(cls, data: Any) -> Any:
        # Older specs said `temperature: 0` (with n: 1) for a greedy evaluation.
        if isinstance(data, dict) and data.get("temperature") == 0:
            data = {k: v for k, v in data.items() if k != "temperature"}
            if data.get("n", 1) not in (0, 1):
                raise unused("n", "temperature 0 is greedy: one answer per problem; set temperature > 0")
            data["n"], data["greedy"] = 0, True
        return data

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        if self.n == 0 and not self.greedy:
            raise ValueError("n: nothing to evaluate (n is 0 and greedy is off)")
        if self.n == 0:
            for name in ("temperature", "top_p", "ks"):
                if self._changed(name):
                    raise unused(name, "n is 0 (greedy only); set n > 0 to sample answers")
        if any(k > self.n for k in self.ks) and self.n > 0:
            raise ValueError(f"ks: every k must be at most n={self.n}")
        return self


class TrainEvalSpec(EvalSpec):
    """Evaluation of a training job: before, every N steps, and after."""

    data: DataSpec = Field(default_factory=lambda: DataSpec(split="test", limit=30))
    every: int = Field(
        0, ge=0, le=MAX_STEPS, description="Evaluate every N steps (0: only before and after)."
    )
    before: bool = Field(True, description="Evaluate the starting policy too.")


class CheckpointSpec(_Spec):
    every: int = Field(
        10, ge=1, le=MAX_STEPS, description="Save adapter + optimizer + step + RNG every N steps."
    )


class LoggingSpec(_Spec):
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="Weights & Biases mode."
    )
    wandb_project: str = Field("crucible", min_length=1, max_length=128)
    run_name: str | None = Field(None, max_length=128)
    samples_every: int = Field(
        1, ge=0, le=MAX_STEPS, description="Emit one sampled completion as an event every N steps (0: never)."
    )


_ATTEMPTS = Field(
    None,
    ge=1,
    le=10,
    description="Runs allowed when the worker running it is lost (resuming from the last checkpoint); "
    "default: the gateway's setting.",
)


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
        """`rollout.group_size` is GRPO's `method.group_size` (older specs put it in rollout)."""
        if not isinstance(data, dict) or not isinstance(data.get("rollout"), dict):
            return data
        if "group_size" not in data["rollout"]:
            return data
        rollout = dict(data["rollout"])
        size = rollout.pop("group_size")
        method = data.get("method") or {"name": "grpo"}
        if not isinstance(method, dict) or method.get("name", "grpo") != "grpo":
            name = method.get("name") if isinstance(method, dict) else "?"
            raise unused(
                "rollout.group_size",
                f"only GRPO samples groups (method {name} has its own sample counts: see its config)",
            )
        if "group_size" in method and method["group_size"] != size:
            raise ValueError("rollout.group_size: give method.group_size alone")
        return {**data, "rollout": rollout, "method": {**method, "group_size": size}}

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
            raise ValueError(
                f"method.path: {method.name} trains on a JSONL file of {rows} rows; give its path"
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


def check_offline_optim(optim: OptimSpec, method: str, prefix: str = "optim") -> None:
    """The optimiser fields TRL training does not read (its length is the method's epochs / max_steps)."""
    if optim._changed("steps"):
        raise unused(f"{prefix}.steps", f"{method} trains for the method's epochs or max_steps")
    if optim._changed("problems_per_step"):
        raise unused(
            f"{prefix}.problems_per_step", f"{method} samples no problems (micro_batch is its batch)"
        )


class EvalJob(EvalSpec):
    """An evaluation job: an evaluation of a model (its base, optionally with an adapter)."""

    kind: Literal["eval"] = "eval"
    name: str | None = Field(None, max_length=200)
    model: ModelSpec = Field(default_factory=ModelSpec)
    adapter: str | None = Field(
        None, max_length=4096, description="Evaluate this adapter (PEFT directory inside the adapter roots)."
    )
    seed: Seed = Field(0, description="Seeds the sampled answers.")
    max_attempts: int | None = _ATTEMPTS

    @model_validator(mode="after")
    def _check_model(self) -> EvalJob:
        for name in ("lora_r", "lora_alpha", "lora_dropout", "target_modules", "init_adapter"):
            if self.model._changed(name):
                raise unused(f"model.{name}", "an evaluation trains nothing (use `adapter` to evaluate one)")
        for name in ("gradient_checkpointing", "device", "dtype", "attn_implementation"):
            # `sdpa` was the default before `auto`: specs dumped then (queued jobs) stay valid.
            if name == "attn_implementation" and self.model.attn_implementation == "sdpa":
                continue
            if self.model._changed(name):
                raise unused(f"model.{name}", "the generator runs the model of an evaluation, not the job")
        return self


# --- the offline pipeline ------------------------------------------------------------------------

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

    kind: Literal["pipeline"] = "pipeline"
    name: str | None = Field(None, max_length=200, description="Label shown in listings.")
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
            raise ValueError("stages: each stage at most once")
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


JobSpec = Annotated[TrainJob | EvalJob | PipelineJob, Field(discriminator="kind")]


RootKind = Literal["data", "model", "adapter"]


def job_paths(spec: TrainJob | EvalJob | PipelineJob) -> list[tuple[str, str, RootKind]]:
    """Every file-system path a spec names: (dotted field, value, root kind: data | model | adapter).

    Model ids that aren't paths (a built-in name, `org/model` on a hub) are not listed.
    """
    out: list[tuple[str, str, RootKind]] = []

    def data(prefix: str, d: DataSpec | None) -> None:
        if d is not None and d.path:
            out.append((f"{prefix}.path", d.path, "data"))

    if looks_like_path(spec.model.base):
        out.append(("model.base", spec.model.base, "model"))
    if isinstance(spec, EvalJob):
        data("data", spec.data)
        if spec.adapter:
            out.append(("adapter", spec.adapter, "adapter"))
        return out
    data("data", spec.data)
    data("eval.data", spec.eval.data if spec.eval else None)
    if spec.model.init_adapter:
        out.append(("model.init_adapter", spec.model.init_adapter, "adapter"))
    if isinstance(spec, TrainJob) and isinstance(spec.method, SFTConfig | DPOConfig) and spec.method.path:
        out.append(("method.path", spec.method.path, "data"))
    return out


def looks_like_path(name: str) -> bool:
    """A model name meant as a local path: absolute, `./`, `../` or `~` (hub ids are `org/name`).

    >>> looks_like_path("/models/x"), looks_like_path("./m"), looks_like_path("org/model")
    (True, True, False)
    """
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..")
