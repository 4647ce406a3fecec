"""Evaluations: the evaluation section of train and pipeline jobs, and the evaluation job."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from crucible_shared.jobs.base import _ATTEMPTS, MAX_STEPS, Seed, _Spec, invalid, unused
from crucible_shared.jobs.compat import greedy_from_temperature
from crucible_shared.jobs.data import DataSpec, ModelSpec
from crucible_shared.lifecycle import JobKind
from crucible_shared.text import Label


class EvalSampling(_Spec):
    """How an evaluation samples and scores answers: the one set of defaults and bounds, used by
    the job spec (`EvalSpec`) and by the trainer's runner config (`EvalConfig`) alike, so a spec the
    gateway accepts is one the worker can run."""

    greedy: bool = Field(True, description="One greedy answer per problem (greedy pass@1).")
    n: int = Field(0, ge=0, le=1000, description="Sampled answers per problem (0: greedy only).")
    temperature: float = Field(0.8, gt=0, le=5, description="Temperature of the n samples.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus mass of the n samples.")
    max_tokens: int = Field(256, ge=1, le=8192, description="Most tokens per answer.")
    ks: list[Annotated[int, Field(ge=1, le=1000)]] = Field(
        default_factory=lambda: [1], max_length=32, description="pass@k to report (each k <= n)."
    )


class EvalSpec(EvalSampling):
    """An evaluation: which problems, and how answers are sampled and scored.

    `greedy` decodes one answer per problem (greedy pass@1); `n` samples that many more at
    `temperature` / `top_p` for pass@k (k in `ks`, each at most n).
    """

    data: DataSpec = Field(default_factory=lambda: DataSpec(split="test"))

    @model_validator(mode="before")
    @classmethod
    def _legacy_greedy(cls, data: Any) -> Any:
        return greedy_from_temperature(data)  # jobs/compat.py

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        if self.n == 0 and not self.greedy:
            raise invalid("n", "nothing to evaluate (n is 0 and greedy is off)")
        if self.n == 0:
            for name in ("temperature", "top_p", "ks"):
                if self._changed(name):
                    raise unused(name, "n is 0 (greedy only); set n > 0 to sample answers")
        if any(k > self.n for k in self.ks) and self.n > 0:
            raise invalid("ks", f"every k must be at most n={self.n}")
        return self


class TrainEvalSpec(EvalSpec):
    """Evaluation of a training job: before, every N steps, and after."""

    data: DataSpec = Field(default_factory=lambda: DataSpec(split="test", limit=30))
    every: int = Field(
        0, ge=0, le=MAX_STEPS, description="Evaluate every N steps (0: only before and after)."
    )
    before: bool = Field(True, description="Evaluate the starting policy too.")


class EvalJob(EvalSpec):
    """An evaluation job: an evaluation of a model (its base, optionally with an adapter)."""

    kind: Literal[JobKind.eval] = JobKind.eval
    name: Label | None = Field(None, max_length=200, description="Label shown in listings (printable text).")
    model: ModelSpec = Field(default_factory=ModelSpec)
    adapter: str | None = Field(
        None,
        min_length=1,  # "" would evaluate the base model while the spec names an adapter
        max_length=4096,
        description="Evaluate this adapter (PEFT directory inside the adapter roots).",
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
