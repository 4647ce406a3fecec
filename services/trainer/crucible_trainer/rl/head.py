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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from crucible_trainer.runtime.hardware import chunk_tokens

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
