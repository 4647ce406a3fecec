"""The data and model sections: which tasks a job reads, and the base model with its LoRA."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from crucible_shared.jobs.base import Seed, _Spec, invalid, unused

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")

Dataset = Literal["mbpp", "humaneval", "stdio", "jsonl"]
Split = Literal["prompt", "test", "validation", "train", "all"]
# MBPP's splits by task id (inclusive), as the MBPP adapter applies them.
MBPP_SPLITS: dict[str, tuple[int, int]] = {
    "prompt": (1, 10),
    "test": (11, 510),
    "validation": (511, 600),
    "train": (601, 974),
    "all": (1, 974),
}
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
            raise invalid("path", f"a {self.dataset} dataset needs the path of its JSONL file")
        allowed = SPLITS.get(self.dataset, ("all",))
        if self.split not in (None, *allowed):
            raise invalid(
                "split", f"{self.dataset} has no split {self.split!r} (it has: {', '.join(allowed)})"
            )
        if self.ids is not None and self.id_range is not None:
            raise ValueError("ids and id_range: give one of them, not both")
        if self.ids is not None and not self.ids:
            raise invalid("ids", "empty list")
        if self.id_range is not None and self.id_range[0] > self.id_range[1]:
            raise invalid("id_range", f"start {self.id_range[0]} is after end {self.id_range[1]}")
        if self.dataset == "mbpp" and self.path is None:
            self._check_mbpp_ids()
        if self._changed("challenge_tests") and self.dataset != "mbpp":
            raise unused("challenge_tests", f"only MBPP has challenge tests, not {self.dataset}")
        if self.max_cases is not None and self.dataset != "stdio":
            raise unused("max_cases", f"only stdio tasks have cases, not {self.dataset}")
        if self._changed("seed") and not self.shuffle:
            raise unused("seed", "it seeds the shuffle; set shuffle: true or drop it")
        return self

    def _check_mbpp_ids(self) -> None:
        """MBPP's own tasks (no `path`): numeric ids inside the split asked for (all 1-974 when
        none is), so a typo is refused at submission rather than evaluating nothing."""
        low, high = MBPP_SPLITS[self.effective_split]
        where = f"MBPP's {self.effective_split} split (ids {low}-{high})"
        for i, raw in enumerate(self.ids or []):
            text = str(raw).removeprefix("MBPP/")
            if not text.isdigit() or not low <= int(text) <= high:
                raise invalid(f"ids.{i}", f"{raw!r} is not a task of {where}")
        if self.id_range is not None and (self.id_range[0] < low or self.id_range[1] > high):
            raise invalid("id_range", f"{list(self.id_range)} reaches outside {where}")

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

    @field_validator("base", "init_adapter")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        # A name is shown in logs, reports and terminals: ESC, CR/LF and bidi overrides would forge them.
        if value is not None and _CONTROL.search(value):
            raise ValueError("holds a control or bidirectional-override character")
        return value

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
        description="Trade compute for memory in the update; auto: on for the micro-batches that would "
        "not fit in free GPU memory (decided per micro-batch on a GPU, in one process or on each DDP "
        "rank; for the job with FSDP or compiled passes).",
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
