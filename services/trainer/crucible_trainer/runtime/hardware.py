"""Settings a job leaves to the machine: device, dtype, attention kernel, micro-batch, gradient
checkpointing.

`resolve` turns every `auto` of a spec into a value for this machine and says what it chose
(the job logs it at its start). On a GPU the micro-batch comes from free memory and an
estimate of what one sequence costs in the update (`bytes_per_sequence`: activations of every
layer, and the completion's float32 logits and their gradients, or with the chunked head of
rl/head.py, which the policy takes where those do not fit, the completion's hidden states).
Gradient checkpointing on `auto`
is decided per micro-batch by the policy of a one-GPU job (`checkpoint_needed`: that micro-batch's
own rows, width and completion against the memory free when it runs), so short micro-batches run
without recomputing the forward; for several ranks or compiled passes, once for the job, when a
micro-batch of the size asked for (or of 8, for auto) at the longest length would not fit. On a
CPU: 16, off. Anything the spec sets explicitly is kept.
"""

from __future__ import annotations

from typing import Any

from crucible_shared.jobs import TrainJob

CPU_MICRO_BATCH = 16
MEMORY_SHARE = (
    0.6  # of free GPU memory for the update's activations (weights and optimizer are in it already)
)
# Of the memory free when a micro-batch runs (the process's cached blocks included) that its
# estimate may fill without checkpointing: the estimate is already above every measured peak.
MICRO_BATCH_SHARE = 0.85
PROMPT_TOKENS = 512  # a generous guess at prompt length (chat template + problem)
# Most logits one chunk of rl/head.py's chunked head holds (float32: 512 MiB), so that a chunk's
# transient memory stays bounded whatever the micro-batch.
CHUNK_ELEMENTS = 2**27


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the chunked head: at most `CHUNK_ELEMENTS` logits at once.

    >>> chunk_tokens(151936), chunk_tokens(49152)
    (883, 2730)
    """
    return max(1, CHUNK_ELEMENTS // vocab)


def bytes_per_sequence(
    config: Any, tokens: int, completion: int, dtype_bytes: int, attention: str = "sdpa", head: str = "full"
) -> int:
    """Memory one sequence costs in a forward/backward pass without checkpointing: per token and
    layer `(18 h + 6 i) · dtype_bytes / 2` bytes (the tensors saved for the backward: the norms',
    attention's and projections' inputs, about 9 h, and the gated MLP's gate, up and product, 3 i;
    SDPA keeps no attention scores), plus, per completion token, 16 bytes a vocabulary entry with
    the full logits through autograd (`head="full"`: the logits, their float32 copy, log-softmax
    and gradient), twice `dtype_bytes` with the full logits through the kept logits' kernels
    (`"kept"`, rl/head.py `kept_logprobs`: the logits and their gradient, in the model's dtype; bf16
    peaks measured on an H200 fit under it), or 8 bytes a
    hidden unit with the chunked head (`"chunked"`: its hidden state and that state's gradient;
    the chunks' own logits are `head_workspace` per micro-batch). Eager attention
    (`attention`) also keeps every head's scores and probabilities: `2 · heads · tokens²` values a layer.

    Fitted to peaks measured on an H200 (docs/benchmarks.md, "The update at a real batch's
    lengths"): Qwen2.5-Coder-1.5B 1.99 MiB per token and 2.28 MiB more per completion token,
    under this estimate's 2.17 and 2.32 MiB (75.9 GiB for 32 rows of 784 tokens, 384 of them
    completion, against 81.1 GiB here); SmolLM2-135M 13.0 GiB for 32 rows of 456 tokens (256
    completion) against 14.0 GiB here.

    >>> class C: num_hidden_layers, hidden_size, intermediate_size, vocab_size = 30, 576, 1536, 49152
    >>> round(bytes_per_sequence(C, 456, 256, 2) / 2**20)
    447
    >>> [round(bytes_per_sequence(C, 456, 256, n, head="kept") / 2**20) for n in (2, 4)]  # bf16, float32
    [303, 607]
    """
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    activations = config.num_hidden_layers * tokens * (18 * hidden + 6 * intermediate) * dtype_bytes // 2
    per_entry = {"full": 16, "kept": 2 * dtype_bytes}.get(head)
    logits = completion * (config.vocab_size * per_entry if per_entry else hidden * 8)
    scores = 0
    if attention == "eager":
        scores = config.num_hidden_layers * 2 * config.num_attention_heads * tokens * tokens * dtype_bytes
    return activations + logits + scores


def checkpoint_needed(
    config: Any, rows: int, width: int, tail: int, dtype_bytes: int, free: int, attention: str = "sdpa",
    head: str = "full",
) -> bool:  # fmt: skip
    """Whether a micro-batch of `rows` sequences `width` tokens wide, the last `tail` of them its
    completion, needs gradient checkpointing with `free` bytes available (`head`: as in
    `bytes_per_sequence`).

    >>> class C: num_hidden_layers, hidden_size, intermediate_size, vocab_size = 30, 576, 1536, 49152
    >>> checkpoint_needed(C, 32, 456, 256, 2, 17 * 2**30), checkpoint_needed(C, 32, 456, 256, 2, 16 * 2**30)
    (False, True)
    >>> checkpoint_needed(C, 32, 456, 256, 2, 12 * 2**30, head="chunked")
    False
    """
    need = rows * bytes_per_sequence(config, width, tail, dtype_bytes, attention, head)
    need += head_workspace(config, rows * tail) if head == "chunked" else 0
    return need > MICRO_BATCH_SHARE * free


def head_workspace(config: Any, completion: int) -> int:
    """The chunked head's transient memory in a micro-batch of `completion` completion tokens
    (rl/head.py): one chunk's logits in the layer's dtype and float32, their exponent and gradient.

    >>> class C: vocab_size = 151936
    >>> head_workspace(C, 100) / 2**20, round(head_workspace(C, 10_000) / 2**30, 2)
    (231.8359375, 2.0)
    """
    return 16 * config.vocab_size * min(completion, chunk_tokens(config.vocab_size))


def resolve(spec: TrainJob, base: str | None = None) -> tuple[TrainJob, dict[str, Any]]:
    """The spec with every `auto` replaced, and the choices made (for the job's log). `base`: where
    the model's files are read (the run's snapshot of a local `model.base`; default the spec's)."""
    base = base or spec.model.base
    import torch
    from crucible_models import pick_attention, pick_device, pick_dtype, resolve_model_path
    from transformers import AutoConfig

    device = pick_device(spec.model.device)
    dtype = pick_dtype(device, spec.model.dtype)
    micro, checkpointing = spec.optim.micro_batch, spec.model.gradient_checkpointing
    chosen: dict[str, Any] = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": pick_attention(spec.model.attn_implementation, base),
    }
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        config = AutoConfig.from_pretrained(resolve_model_path(base))
        tokens = PROMPT_TOKENS + spec.rollout.max_tokens
        # With the full logits, as the policy computes them where they fit (rl/head.py's chunked
        # head is its way out for a micro-batch that does not, decided when it runs): on CUDA,
        # eager, through the kept logits' kernels (`Policy.logprob_kernel`), else autograd's. A step
        # run again without the fused kernels (its gradient not finite) holds autograd's float32
        # logits; in one process a pass that then runs out of memory runs again holding less.
        head = "full" if spec.optim.compile else "kept"
        per_sequence = bytes_per_sequence(
            config, tokens, spec.rollout.max_tokens, dtype.itemsize, chosen["attn_implementation"], head
        )
        fits = max(1, int(MEMORY_SHARE * free // per_sequence))
        if micro == "auto":
            micro = min(256, 1 << (fits.bit_length() - 1))  # a power of two that fits
        sharded = spec.distributed.train_gpus > 1 and spec.distributed.strategy == "fsdp"
        if checkpointing == "auto" and (spec.optim.compile or sharded):
            # A compiled graph, or FSDP ranks, keep one setting for the job: under FSDP a
            # checkpointed layer gathers its weights again in the backward, a collective every rank
            # must run alike. One process, or DDP ranks (whose backwards run no collective:
            # distributed/parallel.py), decide per micro-batch (`checkpoint_needed`, in the policy)
            # and keep `auto`.
            checkpointing = fits < (micro if micro != "auto" else 8)
        chosen.update(
            gpu_free_gb=round(free / 2**30, 1),
            gpu_total_gb=round(total / 2**30, 1),
            sequence_mb=round(per_sequence / 2**20),
        )
    if micro == "auto":
        micro = CPU_MICRO_BATCH
    if checkpointing == "auto" and not device.startswith("cuda"):
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
