"""Next-token sampling for a batch whose rows each carry their own parameters and random generator.

Logprobs are always the log-softmax of the model's raw logits (temperature 1, before top-p/top-k),
like vLLM's default `logprobs_mode="raw_logprobs"`: the trainer compares them with its own policy's
logprobs, which are computed without any sampling transform. A per-row `torch.Generator` makes a
seeded request's random draws independent of whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the top-p nucleus of a 1-D logit row."""
    out = logits
    if top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token when the mass strictly before it is below top_p (the first token always stays).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


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
        temperatures = torch.tensor([rows[i].temperature for i in sampled], device=logits.device)
        scaled = logits[sampled] / temperatures.unsqueeze(1)
        for j, i in enumerate(sampled):
            if rows[i].top_p < 1.0 or rows[i].top_k > 0:
                scaled[j] = filter_logits(scaled[j], rows[i].top_p, rows[i].top_k)
        probs = torch.softmax(scaled, dim=-1)
        # One draw per generator: rows sharing one (unseeded requests) are drawn together.
        groups: dict[int, list[int]] = {}
        for j, i in enumerate(sampled):
            groups.setdefault(id(rows[i].generator), []).append(j)
        for members in groups.values():
            generator = rows[sampled[members[0]]].generator
            draws = torch.multinomial(probs[members], 1, generator=generator).squeeze(1)
            tokens[[sampled[j] for j in members]] = draws
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
