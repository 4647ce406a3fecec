"""The update's log-probabilities without the vocabulary-wide logits of every completion token.

A training forward used to keep, for each completion token, its logits over the whole vocabulary
in the model's dtype and in float32, their log-softmax and the gradient of each: 16 bytes per
token and vocabulary entry, 2.3 MiB per completion token at Qwen2.5's 151,936 entries, more than
the rest of the model's activations (docs/benchmarks.md, "The update at a real batch's lengths").
That is what held a micro-batch's size down and switched gradient checkpointing on.

Here the model's forward stops before its output layer (the layer's `forward` passes its input
through while the call runs, so any wrapper around the model, DDP's included, sees the same
call), and `TokenLogprobs` takes the hidden states of the completion tokens only (none of the
padding in a micro-batch's tail) through the output layer a chunk of tokens at a time, keeping
only each token's log-sum-exp. Its backward recomputes each chunk's logits (one more product
with the output layer, about 5% of a 1.5B model's update) and turns them into the gradient of the
hidden states: `(onehot - softmax) · g` times the layer's weight. The values are the ones the
full logits gave: the same product in the same dtype, then float32.

It applies where the causal-LM's forward is exactly `lm_head(hidden)`: families whose head is a
plain, frozen `nn.Linear` with nothing applied to the logits after it (`plain_head`). Soft-capped
or scaled logits (Gemma-2, Cohere, Granite) and heads with an adapter keep the full logits.
When it is used is the policy's choice (`Policy._plan`): where the full logits of a training
micro-batch would not fit in a GPU's free memory, and always on a CPU.

Where the full logits are kept (a GPU with the memory for them), `kept_logprobs` takes the log-probs
from them without their float32 copy. Autograd's way (`logits.float()`, `gather`, `logsumexp` and
their backwards) writes and reads several float32 tensors as large as the logits, each way, and
keeps one for the backward: memory-bound kernels that took a sixth of the 135M reference's time
(docs/benchmarks.md). `KeptLogprobs` computes each token's log-sum-exp from the model-dtype logits
in one reduction, and its backward writes `(onehot - softmax) · g` straight into the logits' dtype,
the last position's zero row included: the same values in the same float32, through two kernels
that torch.compile fuses (`kept_kernels`; on CUDA, where it is used). It keeps only the logits the
model already made, not a float32 copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

from crucible_trainer.runtime.hardware import chunk_tokens

log = logging.getLogger(__name__)

# Families whose causal-LM forward returns `lm_head(hidden)` unchanged (transformers 5): the
# chunked head computes exactly their logits. Others keep the full logits.
PLAIN_HEAD_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "phi3",
        "gemma",
        "gemma3_text",
        "gpt_oss",
        "starcoder2",
        "olmo",
        "olmo2",
        "granite_code",
    }
)
# Config fields that transform the logits after the head when set (soft-capping, scaling).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def plain_head(config: Any) -> bool:
    """Whether a model of `config` (its text config) computes its logits as `lm_head(hidden)`."""
    if getattr(config, "model_type", None) not in PLAIN_HEAD_FAMILIES:
        return False
    return all(getattr(config, name, None) in (None, 1, 1.0) for name in LOGIT_TRANSFORMS)


def output_layer(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The causal LM's output layer if the chunked head may stand in for it (a plain, frozen
    `nn.Linear` of a `plain_head` family), else None. `model`: the causal LM (PEFT's base model)."""
    config = model.config.get_text_config()
    head = model.get_output_embeddings()
    if not plain_head(config) or type(head) is not torch.nn.Linear:
        return None
    if head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad):
        return None
    return head


@contextmanager
def hidden_out(head: torch.nn.Module) -> Iterator[None]:
    """While open, `head` returns its input: the model's forward yields the final hidden states
    where it yielded logits (`logits_to_keep` still picks the positions)."""
    head.forward = _passthrough  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        del head.forward


def unmasked_hidden(
    runner: torch.nn.Module,
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """[B, k + 1, H] final hidden states of the last `k + 1` positions of the left-padded batch
    (`input_ids`, `attention_mask`), computed by `runner` (the causal LM, whose output layer is
    `head`) with each row's padding moved to its end and no attention mask: the causal mask alone
    keeps every real token from the padding after it. SDPA then runs its flash kernel (and grouped
    key/value heads as they are) where a padding mask held it to the memory-efficient kernel on
    copied key/value heads; the values are the masked forward's (tests/unit/test_update_unmasked.py)."""
    rows, width = input_ids.shape
    shift = width - attention_mask.sum(-1, keepdim=True)  # each row's left padding
    columns = torch.arange(width, device=input_ids.device)
    # Each row rolled left by its padding: the padding (pad ids) wraps round to the end.
    ids = input_ids.gather(1, (columns + shift) % width)
    with hidden_out(head):
        hidden = runner(
            input_ids=ids,
            position_ids=columns.expand(rows, -1),
            logits_to_keep=0,  # every position's hidden state: the rows' tails end apart
            use_cache=False,
        ).logits
    # Back to the left-padded layout's last k + 1 positions (a padding position there takes some
    # padding's state, which the tail mask drops).
    window = (columns[width - k - 1 :] - shift) % width
    return hidden.gather(1, window.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def _passthrough(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


class TokenLogprobs(torch.autograd.Function):
    """log p(target) of each row of `hidden` ([N, H]) under the output layer (`weight` [V, H],
    `bias` [V] or None), float32 [N], computed and differentiated `chunk` tokens at a time."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:  # fmt: skip
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                logits = _logits(hidden[s : s + chunk], weight, bias)
                lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
                out[s : s + chunk] = picked - lse[s : s + chunk]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], ctx.chunk):
                g = grad[s : s + ctx.chunk]
                logits = _logits(hidden[s : s + ctx.chunk], weight, bias)
                # d log p(t) / d logits = onehot(t) - softmax(logits), times the incoming gradient.
                grad_logits = torch.exp(logits - lse[s : s + ctx.chunk, None]).mul_(-g[:, None])
                grad_logits.scatter_add_(-1, targets[s : s + ctx.chunk, None], g[:, None])
                # In the layer's dtype, as autograd's linear backward took the logits' gradient.
                grad_hidden[s : s + ctx.chunk] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
        return grad_hidden, None, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The output layer's logits of `hidden` in its own dtype (as the model's forward computed
    them, under autocast too: the layer's dtype is the compute dtype), then float32."""
    return torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()


def tail_logprobs(
    hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, tail_mask: torch.Tensor
) -> torch.Tensor:
    """[B, K] log-probabilities of `targets` ([B, K]) from the hidden states that predict them
    (`hidden` [B, K, H]) on the completion tokens (`tail_mask`), 0 elsewhere."""
    keep = tail_mask.bool()
    picked = TokenLogprobs.apply(
        hidden[keep], head.weight, head.bias, targets[keep], chunk_tokens(head.weight.shape[0])
    )
    return torch.zeros(tail_mask.shape, dtype=torch.float32, device=hidden.device).masked_scatter(
        keep, picked
    )


def kept_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, tail_mask: torch.Tensor, compiled: bool = True
) -> torch.Tensor:
    """[B, K] float32 log-probabilities of `targets` ([B, K]) on the completion tokens (`tail_mask`),
    0 elsewhere, from the kept logits [B, K + 1, V] (the last position predicts nothing): what
    `(logits[:, :-1].float().gather(targets) - logsumexp) * tail_mask` gives, without its float32
    copies. `compiled`: through `kept_kernels` (else the same functions eager)."""
    kernels = kept_kernels() if compiled else (_kept_forward, _kept_backward)
    return KeptLogprobs.apply(logits, targets, tail_mask, kernels)


class KeptLogprobs(torch.autograd.Function):
    """`kept_logprobs`' values and gradient: the forward keeps the logits (the model's own tensor)
    and each token's log-sum-exp, the backward returns the logits' gradient in their dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, kernels: tuple
    ) -> torch.Tensor:
        logp, lse = kernels[0](logits, targets, mask)
        ctx.save_for_backward(logits, targets, mask, lse)
        ctx.backward_kernel = kernels[1]
        return logp

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        logits, targets, mask, lse = ctx.saved_tensors
        return ctx.backward_kernel(logits, targets, mask, lse, grad), None, None, None


def _kept_forward(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits[:, :-1, :].float()
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (picked - lse) * mask, lse


def _kept_backward(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    x = logits[:, :-1, :].float()
    # d log p(t) / d logits = onehot(t) - softmax(logits), times the incoming gradient (masked as
    # the forward's product masked it); the iota comparison is elementwise, so it fuses.
    onehot = torch.arange(x.shape[-1], device=x.device) == targets.unsqueeze(-1)
    dx = (onehot.to(x.dtype) - torch.exp(x - lse.unsqueeze(-1))) * (grad * mask).unsqueeze(-1)
    return torch.nn.functional.pad(dx.to(logits.dtype), (0, 0, 0, 1))  # the last position: zeros


@cache
def kept_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`_kept_forward` and `_kept_backward` compiled once per process, every dimension dynamic (one
    graph each for all batch shapes and vocabularies): each is a fused kernel or two. Where the
    compiler fails (no C compiler for Triton's launchers, say), each runs eager from then on."""
    log.info("compiling the kept logits' log-prob kernels on first use")
    forward, backward = (torch.compile(f, dynamic=True) for f in (_kept_forward, _kept_backward))
    return _or_eager(forward, _kept_forward), _or_eager(backward, _kept_backward)


def _or_eager(compiled: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled`, or `eager` (the same function uncompiled) for good once `compiled` has failed:
    the same values, with the float32 copy as a transient. Running out of memory is not the
    compiler's failure: it propagates."""
    failed = False

    def run(*args: Any) -> Any:
        nonlocal failed
        if not failed:
            try:
                return compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception:  # the compiler's own (inductor, Triton): its message goes to the log
                log.warning("the kept logits' kernels did not compile; they run eager", exc_info=True)
                failed = True
        return eager(*args)

    return run
