"""Next-token sampling for a batch whose rows each carry their own parameters and random generator.

Logprobs are always the log-softmax of the model's raw logits (temperature 1, before top-p/top-k),
like vLLM's default `logprobs_mode="raw_logprobs"`: the trainer compares them with its own policy's
logprobs, which are computed without any sampling transform. A per-row `torch.Generator` makes a
seeded request's random draws independent of whatever else shares its batch.

Everything is batched over rows: one sort for every row's top-k/top-p filter, one softmax, and
the "exponential race" (`argmax(p / q)` with `q ~ Exp(1)`, an exact draw from `p`) so that each
generator fills only its own rows' noise with a single kernel. A per-row Python loop of
filters and `multinomial` calls cost hundreds of kernel launches per decode step at batch 64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .transfer import to_device

# vLLM treats temperatures below this as greedy decoding.
GREEDY_EPSILON = 1e-5


@dataclass
class RowParams:
    """How to sample one row; `top_k <= 0` and `top_p == 1` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


@dataclass
class SampleOutput:
    """The sampled token of every row, its raw logprob and, when asked, the top-k raw logprobs."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor | None = None  # [B, k] int64
    top_logprobs: torch.Tensor | None = None  # [B, k] float32


def filter_logits(
    logits: torch.Tensor, top_p: float | torch.Tensor, top_k: int | torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and top-p nucleus.

    `logits` is one row `[V]` or a batch `[B, V]`; `top_p` / `top_k` are scalars or one value per
    row (`top_k <= 0` keeps all, `top_p >= 1` keeps all). One descending sort serves both filters.
    """
    single = logits.dim() == 1
    rows = logits.unsqueeze(0) if single else logits
    batch, vocab = rows.shape
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=rows.device).reshape(-1, 1).expand(batch, 1)
    top_k = torch.as_tensor(top_k, dtype=torch.long, device=rows.device).reshape(-1, 1).expand(batch, 1)
    sorted_logits, order = torch.sort(rows, dim=-1, descending=True)
    rank = torch.arange(vocab, device=rows.device).unsqueeze(0)
    drop = (top_k > 0) & (rank >= top_k)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token when the mass strictly before it is below top_p (the first token always stays).
    drop |= ((torch.cumsum(probs, dim=-1) - probs) >= top_p) & (top_p < 1.0)
    out = rows.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return out[0] if single else out


def sample(logits: torch.Tensor, rows: list[RowParams], num_top: int = 0) -> SampleOutput:
    """Pick the next token of each row of `logits` ([B, V], any float dtype).

    Greedy rows take the argmax; the others draw from softmax(filtered logits / temperature) with
    their own generator (or torch's default one when None).
    """
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if sampled:
        device = logits.device
        index = to_device(sampled, device) if len(sampled) < len(rows) else None
        part = logits if index is None else logits[index]
        temperatures = to_device([rows[i].temperature for i in sampled], device, torch.float32)
        scaled = part / temperatures.unsqueeze(1)
        if any(rows[i].top_p < 1.0 or rows[i].top_k > 0 for i in sampled):
            top_p = to_device([rows[i].top_p for i in sampled], device, torch.float32)
            top_k = to_device([rows[i].top_k for i in sampled], device, torch.long)
            scaled = filter_logits(scaled, top_p, top_k)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        # One fill per generator: rows sharing one (unseeded requests) draw together, and a
        # seeded row's noise comes only from its own generator, whatever shares the batch.
        groups: dict[int, list[int]] = {}
        for j, i in enumerate(sampled):
            groups.setdefault(id(rows[i].generator), []).append(j)
        for members in groups.values():
            generator = rows[sampled[members[0]]].generator
            if len(members) == 1:
                noise[members[0]].exponential_(generator=generator)
            elif members == list(range(members[0], members[0] + len(members))):
                noise[members[0] : members[0] + len(members)].exponential_(generator=generator)
            else:
                fill = torch.empty((len(members), probs.shape[1]), device=device).exponential_(
                    generator=generator
                )
                noise[to_device(members, device)] = fill
        # Exp(1) can return exactly 0 (a division by zero would pick a zero-probability token).
        draws = torch.argmax(probs / noise.clamp_(min=1e-20), dim=-1)
        if index is None:
            tokens = draws
        else:
            tokens[index] = draws
    chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    out = SampleOutput(tokens=tokens, logprobs=chosen)
    if num_top > 0:
        top = torch.topk(raw_logprobs, num_top, dim=-1)
        out.top_ids, out.top_logprobs = top.indices, top.values
    return out


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed` (reduced to the 64-bit range torch accepts)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % (2**64))
    return gen
