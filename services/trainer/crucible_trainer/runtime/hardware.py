"""Settings a job leaves to the machine: device, dtype, attention kernel, micro-batch, gradient
checkpointing.

`resolve` turns every `auto` of a spec into a value for this machine and says what it chose
(the job logs it at its start). On a GPU the micro-batch comes from free memory and an
estimate of what one sequence costs in the update (activations of every layer, the float32
logits of the completion and their gradients); gradient checkpointing turns on when a
micro-batch of the size asked for (or of 8, for auto) would not fit. On a CPU: 16, off.
Anything the spec sets explicitly is kept.
"""

from __future__ import annotations

from typing import Any

from crucible_shared.jobs import TrainJob

CPU_MICRO_BATCH = 16
MEMORY_SHARE = (
    0.6  # of free GPU memory for the update's activations (weights and optimizer are in it already)
)
PROMPT_TOKENS = 512  # a generous guess at prompt length (chat template + problem)


def bytes_per_sequence(config: Any, tokens: int, completion: int, dtype_bytes: int) -> int:
    """Memory one sequence costs in a forward/backward pass (Korthikanti et al.'s 34·h bytes per
    token and layer at 16 bits, without attention scores: SDPA/flash keep none), plus the fp32
    logits of the completion, their log-softmax and gradient.

    >>> class C: num_hidden_layers, hidden_size, vocab_size = 30, 576, 49152
    >>> round(bytes_per_sequence(C, 768, 256, 2) / 2**20)
    574
    """
    activations = config.num_hidden_layers * tokens * 34 * config.hidden_size * dtype_bytes // 2
    logits = completion * config.vocab_size * 4 * 3
    return activations + logits


def resolve(spec: TrainJob) -> tuple[TrainJob, dict[str, Any]]:
    """The spec with every `auto` replaced, and the choices made (for the job's log)."""
    import torch
    from crucible_models import pick_attention, pick_device, pick_dtype, resolve_model_path
    from transformers import AutoConfig

    device = pick_device(spec.model.device)
    dtype = pick_dtype(device, spec.model.dtype)
    micro, checkpointing = spec.optim.micro_batch, spec.model.gradient_checkpointing
    chosen: dict[str, Any] = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": pick_attention(spec.model.attn_implementation, spec.model.base),
    }
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        config = AutoConfig.from_pretrained(resolve_model_path(spec.model.base))
        tokens = PROMPT_TOKENS + spec.rollout.max_tokens
        per_sequence = bytes_per_sequence(config, tokens, spec.rollout.max_tokens, dtype.itemsize)
        fits = max(1, int(MEMORY_SHARE * free // per_sequence))
        if micro == "auto":
            micro = min(256, 1 << (fits.bit_length() - 1))  # a power of two that fits
        if checkpointing == "auto":
            checkpointing = fits < (micro if micro != "auto" else 8)
        chosen.update(
            gpu_free_gb=round(free / 2**30, 1),
            gpu_total_gb=round(total / 2**30, 1),
            sequence_mb=round(per_sequence / 2**20),
        )
    if micro == "auto":
        micro = CPU_MICRO_BATCH
    if checkpointing == "auto":
        checkpointing = False
    chosen.update(micro_batch=micro, gradient_checkpointing=checkpointing)
    resolved = spec.model_copy(
        update={
            "optim": spec.optim.model_copy(update={"micro_batch": micro}),
            "model": spec.model.model_copy(
                update={
                    "gradient_checkpointing": checkpointing,
                    "device": device,
                    "dtype": chosen["dtype"],
                    "attn_implementation": chosen["attn_implementation"],
                }
            ),
        }
    )
    return resolved, chosen


def offline_settings(
    micro: int | str,
    checkpointing: bool | str,
    *,
    device: str,
    config: Any,
    tokens: int,
    rows_per_pair: int,
    dtype_bytes: int = 2,
) -> tuple[int, bool]:
    """An SFT / DPO run's micro-batch and gradient checkpointing with `auto` resolved (TRL takes
    numbers), chosen as `resolve` chooses them: a row is `rows_per_pair` sequences (DPO: chosen and
    rejected) of `tokens` (the method's max_length), all of them trained on.

    >>> offline_settings("auto", "auto", device="cpu", config=None, tokens=1024, rows_per_pair=1)
    (16, False)
    >>> offline_settings(4, True, device="cpu", config=None, tokens=1024, rows_per_pair=2)
    (4, True)
    """
    if device.startswith("cuda") and config is not None and "auto" in (micro, checkpointing):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        per_row = rows_per_pair * bytes_per_sequence(config, tokens, tokens, dtype_bytes)
        fits = max(1, int(MEMORY_SHARE * free // per_row))
        if micro == "auto":
            micro = min(256, 1 << (fits.bit_length() - 1))
        if checkpointing == "auto":
            checkpointing = fits < (micro if isinstance(micro, int) else 8)
    return (
        micro if isinstance(micro, int) else CPU_MICRO_BATCH,
        checkpointing if isinstance(checkpointing, bool) else False,
    )


def release_memory() -> None:
    """Give back what a finished job held. The worker runs job after job in one process, and a job's
    model, optimizer and batches sit in reference cycles (modules, hooks and closures referring to
    each other) that only the cycle collector frees; glibc then keeps the freed heap unless asked
    to return it (measured on CPU: 6.5 GB resident after a two-step job, 3.7 after collecting,
    0.5 after trimming)."""
    import ctypes
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass
