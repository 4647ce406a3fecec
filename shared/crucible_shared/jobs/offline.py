"""Offline methods trained with TRL on a JSONL file: SFT and DPO."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from crucible_shared.jobs.base import MAX_STEPS, _Method, invalid, unused
from crucible_shared.jobs.sections import OptimSpec

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


class _OfflineMethod(_Method):
    """What SFT and DPO share: the data file, the training length and the sequence cap."""

    offline = True

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
            raise invalid("loss_type", "each loss type at most once")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise invalid(
                "loss_weights", f"{len(self.loss_weights)} weights for {len(self.loss_type)} loss types"
            )
        if self.loss_weights is not None and len(self.loss_type) == 1:
            raise unused("loss_weights", "there is one loss type; weights combine several")
        smoothed = _SMOOTHED_LOSSES & set(self.loss_type)
        if self._changed("label_smoothing") and not smoothed:
            raise unused("label_smoothing", f"only the {', '.join(sorted(_SMOOTHED_LOSSES))} losses read it")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0:
            raise invalid("label_smoothing", "the exo_pair loss needs it > 0 (EXO recommends 1e-3)")
        return self


OfflineMethod = Annotated[SFTConfig | DPOConfig, Field(discriminator="name")]


def check_offline_optim(optim: OptimSpec, method: str, prefix: str = "optim") -> None:
    """The optimiser fields TRL training does not read (its length is the method's epochs / max_steps)."""
    if optim._changed("steps"):
        raise unused(f"{prefix}.steps", f"{method} trains for the method's epochs or max_steps")
    if optim._changed("problems_per_step"):
        raise unused(
            f"{prefix}.problems_per_step", f"{method} samples no problems (micro_batch is its batch)"
        )
    if optim._changed("length_buckets"):
        raise unused(f"{prefix}.length_buckets", f"{method} batches its rows with TRL's own collator")
    if optim._changed("early_update"):
        raise unused(f"{prefix}.early_update", f"{method} runs no programs for its update to wait on")
    if optim._changed("compile"):
        raise unused(f"{prefix}.compile", f"{method} trains with TRL's trainer, which compiles nothing here")
