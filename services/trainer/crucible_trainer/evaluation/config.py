"""`EvalConfig`: how an evaluation samples from the model and runs what it wrote."""

from __future__ import annotations

from typing import Any

from crucible_shared.jobs import EvalSpec
from crucible_shared.sandbox import Limits
from pydantic import BaseModel, ConfigDict, Field, model_validator


class EvalConfig(BaseModel):
    """Sampling, scoring and pacing of one evaluation (JSON-serialisable: it travels inside job specs)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None, description="Base model or LoRA adapter name on the generator; None: its base model."
    )
    n: int = Field(
        default=10, ge=0, le=1024, description="Samples per problem at `temperature` (0: greedy only)."
    )
    temperature: float = Field(
        default=0.8, ge=0, le=2.0, description="Temperature of the n samples (0: they are greedy too)."
    )
    top_p: float = Field(default=0.95, gt=0, le=1.0, description="Nucleus sampling mass of the n samples.")
    max_tokens: int = Field(default=512, ge=1, le=32768, description="Most tokens generated per answer.")
    greedy: bool = Field(
        default=True, description="Also decode one greedy answer per problem (greedy pass@1)."
    )
    ks: list[int] = Field(default=[1, 10], description="pass@k reported for each k <= n.")
    seed: int = Field(default=0, description="Base seed; each problem samples with a seed derived from it.")
    chat: bool = Field(default=True, description="Chat prompts (instruct models); False: plain completion.")
    stop: list[str] | None = Field(
        default=None, description="Stop strings; None: the prompt style's defaults (none for chat)."
    )
    sanitize: bool = Field(
        default=True, description="Drop top-level example calls and asserts from function answers."
    )
    limits: Limits = Field(
        default_factory=Limits, description="Sandbox limits per run (unset: its defaults)."
    )
    concurrency: int = Field(default=64, ge=1, le=4096, description="Generation requests in flight at once.")
    execution_batch: int = Field(default=64, ge=1, le=4096, description="Most runs per sandbox batch call.")
    keep_completions: bool = Field(default=True, description="Store each raw completion in the report.")

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.n == 0 and not self.greedy:
            raise ValueError("nothing to evaluate: n is 0 and greedy is off")
        if any(k < 1 for k in self.ks):
            raise ValueError(f"ks must be positive, got {self.ks}")
        self.ks = sorted(set(self.ks))
        return self

    @classmethod
    def from_spec(
        cls, spec: EvalSpec, *, model: str | None, chat: bool, seed: int, **runner: Any
    ) -> EvalConfig:
        """The one way from a job's evaluation spec to a runner config (eval jobs, in-training
        evaluations and `crucible eval` alike); `runner` sets the pacing and prompt knobs."""
        return cls(
            model=model,
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            max_tokens=spec.max_tokens,
            greedy=spec.greedy,
            ks=spec.ks if spec.n else [1],
            seed=seed,
            chat=chat,
            **runner,
        )

    @property
    def reported_ks(self) -> list[int]:
        """The ks pass@k is computed for: those not above n."""
        return [k for k in self.ks if k <= self.n]
