"""The sections of a train job besides its method: rollout, reward, optimisation, publishing,
checkpoints and logging."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from crucible_shared.jobs.base import MAX_STEPS, _Spec, invalid, unused
from crucible_shared.sandbox import Limits
from crucible_shared.text import Label

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
        0.0,
        ge=0,
        le=100,
        description="alpha in r - alpha * generated_tokens / 100 (group advantages take their spread from r before it).",
    )
    time_limit_s: float = Field(
        5.0,
        gt=0,
        le=60,
        description="Wall-clock limit of one program's run (a step waits for its slowest program).",
    )

    def limits(self) -> Limits:
        """The sandbox limits of one program's run (every site that runs a reward's programs uses
        these, so none falls back to the server's defaults).

        >>> limits = RewardSpec(time_limit_s=3).limits()
        >>> limits.wall_time_s, limits.test_time_s
        (3.0, 3.0)
        """
        return run_limits(self.time_limit_s)


def run_limits(time_limit_s: float) -> Limits:
    """`time_limit_s` as sandbox limits: the budget of the whole run and of each of its tests."""
    return Limits(wall_time_s=time_limit_s, test_time_s=time_limit_s)


class OptimSpec(_Spec):
    """Optimisation of the LoRA parameters (AdamW)."""

    @model_validator(mode="after")
    def _check_micro_batch(self) -> OptimSpec:
        if self.micro_batch != "auto" and not 1 <= self.micro_batch <= 4096:
            raise invalid("micro_batch", "between 1 and 4096, or auto")
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
    length_buckets: bool = Field(
        True,
        description="Fill each optimizer step's micro-batches longest first, so each pads to its own "
        "longest sequence (the same gradients, less padding); false: in the batch's order.",
    )
    early_update: bool | Literal["auto"] = Field(
        "auto",
        description="Run a step's forward and backward passes on the groups already scored while the "
        "sandbox still runs the step's last programs, and take the optimizer step when the last group "
        "is scored (the same gradient, sooner). It needs GRPO without dynamic sampling or batch "
        "scaling, num_iterations 1, no KL term, grad_accum unset, one training process and no overlap; "
        "auto: on a GPU where the job allows it; true: also on a CPU (refused where the job does not "
        "allow it); false: the update starts once every program has run.",
    )
    compile: Literal[False, "default"] = Field(
        False,
        description="Run the update's forward and backward passes (training, the old and reference "
        "scoring) through torch.compile's default mode, each micro-batch padded to a multiple of 64 "
        "tokens so few shapes occur; false: eager. One process only (distributed.train_gpus 1).",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _no_cuda_graphs(cls, value: object) -> object:
        # Measured on an H200 (PyTorch 2.11): under reduce-overhead the first update's backward read
        # activations that the CUDA graphs had already overwritten, although each forward marked a
        # new step (PyTorch issue 169545), so the mode is refused by name.
        if value == "reduce-overhead":
            raise ValueError(
                "reduce-overhead (CUDA graphs) is not offered: its graphs overwrote activations "
                "the backward still needed; use 'default' or false"
            )
        return value

    max_grad_norm: float | None = Field(
        1.0, gt=0, le=1e6, description="Gradient clipping (None disables it)."
    )
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear learning-rate warm-up.")


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


class CheckpointSpec(_Spec):
    every: int = Field(
        10, ge=1, le=MAX_STEPS, description="Save adapter + optimizer + step + RNG every N steps."
    )


class LoggingSpec(_Spec):
    wandb_mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="Weights & Biases mode; unset: the worker's WANDB_MODE, else offline."
    )
    wandb_project: str = Field("crucible", min_length=1, max_length=128)
    run_name: Label | None = Field(None, max_length=128, description="W&B run name (printable text).")
    samples_every: int = Field(
        1, ge=0, le=MAX_STEPS, description="Emit one sampled completion as an event every N steps (0: never)."
    )
