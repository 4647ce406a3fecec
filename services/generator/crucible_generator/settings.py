"""Generator settings, read from the environment (prefix `CRUCIBLE_GENERATOR_`) or the command line.

Defaults serve the built-in SmolLM2-135M-Instruct on whatever device the host has, on port 8001.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from crucible_shared.settings import split_csv
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    """Everything the generator server needs to start."""

    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_GENERATOR_", extra="ignore")

    model: str = Field(
        default="smollm2-135m-instruct",
        description="Built-in model name, Hugging Face model id or local checkpoint path.",
    )
    served_model_name: str | None = Field(
        default=None, description="Name clients pass as `model` for the base model (default: `model`)."
    )
    host: str = Field(default="127.0.0.1", description="Interface to bind.")
    port: int = Field(default=8001, ge=0, le=65535, description="TCP port (0 picks a free one).")
    device: str = Field(
        default="auto", description="`auto` (CUDA if present, else CPU), `cpu`, `cuda`, `cuda:1`..."
    )
    dtype: str = Field(
        default="auto", description="`auto` (bf16 on CUDA, fp32 on CPU), `float32`, `bfloat16`..."
    )
    max_loras: int = Field(default=4, ge=1, le=256, description="Most LoRA adapters loaded at once.")
    max_lora_rank: int = Field(default=64, ge=1, le=1024, description="Largest LoRA rank accepted.")
    adapter_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=lambda: [Path.cwd()],
        description="Directories (comma-separated) a `lora_path` must lie inside, links resolved: the "
        "adapter store and run dirs the trainer writes to. Any other path is refused (400, "
        "param `lora_path`), so a client cannot make the server read files elsewhere.",
    )
    max_batch_size: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        default="auto",
        description="Most sequences decoded together; `auto`: from the GPU memory (see sizing.py): the "
        "rows whose caches fit at 2,048 tokens when that is 256 or more (and on the eager path), else "
        "as many (up to 512) as the fast path's paged cache holds at 256 tokens each; 64 on a CPU.",
    )
    block_size: int = Field(
        default=16,
        ge=1,
        le=256,
        description="Tokens per block of the fast path's paged key/value cache: rows take blocks as "
        "they grow and give them back when they end (see paged.py). A power of two up to 256.",
    )
    kv_blocks: int | None = Field(
        default=None,
        ge=1,
        description="Blocks of the fast path's paged key/value cache (as vLLM's "
        "`--num-gpu-blocks-override`); default: from the memory budget or the free memory (sizing.py). "
        "Must hold one row at full length.",
    )
    gpu_memory_fraction: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Share of the GPU's memory the generator may take (weights, their merged copy, "
        "caches, graphs, adapters), as vLLM's `--gpu-memory-utilization`: the rows "
        "(`max_batch_size: auto`) and the cache blocks are sized to fit it at start, a set "
        "`max_batch_size` is checked against it, and a model whose weights exceed it does not start "
        "(see sizing.py). Unset: the cache from the memory free after loading. CUDA only.",
    )
    batch_wait_ms: float = Field(
        default=5.0, ge=0, le=1000, description="How long a lone request waits for others to batch with."
    )
    join_wait_ms: float = Field(
        default=20.0,
        ge=0,
        le=1000,
        description="How long a sequence waits to join a running batch while few others wait with it.",
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="Prompt + completion token limit (default: the model's context)."
    )
    max_logprobs: int = Field(default=20, ge=0, description="Most top logprobs a request may ask for.")
    threads: int | None = Field(
        default=None, ge=1, description="CPU threads for torch (default: torch's choice)."
    )
    fast_decode: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Merged-weight static-cache decoding for single-adapter batches (`auto`: on CUDA).",
    )
    cuda_graphs: bool = Field(
        default=True, description="Replay decode steps as CUDA graphs (fast path, CUDA)."
    )
    prefill_graphs: bool = Field(
        default=True,
        description="Replay prefills of up to 16 prompts of up to 512 tokens as CUDA graphs (fast path, CUDA).",
    )
    graph_capture: Literal["idle", "start"] = Field(
        default="idle",
        description="When the CUDA graphs are captured: `idle`: serve at once (steps and prefills not "
        "captured yet run eagerly) and capture one graph at a time whenever nothing waits or decodes; "
        "`start`: all of them before the first batch (13-18 s at 512 rows on an H200), which the "
        "first requests wait for.",
    )
    attention_kernels: Literal["auto", "no_cudnn"] = Field(
        default="auto",
        description="Fast path's attention kernels: PyTorch's choice, or any but cuDNN attention (CUDA).",
    )
    seed: int | None = Field(default=None, description="Seed of the sampler for requests without a `seed`.")
    log_level: str = Field(default="info", description="uvicorn / logging level.")

    @field_validator("adapter_roots", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return split_csv(value)

    @field_validator("adapter_roots")
    @classmethod
    def _absolute(cls, value: list[Path]) -> list[Path]:
        if not value:
            raise ValueError("at least one adapter root is needed")
        return [Path(os.path.abspath(p.expanduser())) for p in value]

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):  # rows are multiples of 256 slots: blocks must divide them
            raise ValueError("block_size must be a power of two up to 256")
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.model.strip():
            raise ValueError("model must not be empty")
        return self

    @property
    def base_model_name(self) -> str:
        """The `model` value that selects the base model."""
        return self.served_model_name or self.model
