"""`EvalConfig`: how an evaluation samples from the model and runs what it wrote."""

from __future__ import annotations

from typing import Any

from crucible_shared.jobs import EvalSampling, EvalSpec
from crucible_shared.sandbox import Limits
from pydantic import Field, model_validator


class EvalConfig(EvalSampling):
    """Sampling, scoring and pacing of one evaluation (JSON-serialisable: it travels inside job specs).

    Its sampling fields (greedy, n, temperature, top_p, max_tokens, ks) are `EvalSampling`'s: the
    same defaults and bounds as a job's evaluation spec. Unlike the spec it accepts ks above n
    (pass@k is reported for those not above it) so one config serves several n.
    """

    model: str | None = Field(
        default=None, description="Base model or LoRA adapter name on the generator; None: its base model."
    )
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
        self.ks = sorted(set(self.ks))
        return self

    @classmethod
    def from_spec(
        cls, spec: EvalSpec, *, model: str | None, chat: bool, seed: int, **runner: Any
    ) -> EvalConfig:
        """The one way from a job's evaluation spec to a runner config (eval jobs, in-training
        evaluations and `crucible eval` alike); `runner` sets the pacing and prompt knobs."""
        sampling = spec.model_dump(include=set(EvalSampling.model_fields))
        return cls(**sampling, model=model, seed=seed, chat=chat, **runner)

    @property
    def reported_ks(self) -> list[int]:
        """The ks pass@k is computed for: those not above n."""
        return [k for k in self.ks if k <= self.n]
