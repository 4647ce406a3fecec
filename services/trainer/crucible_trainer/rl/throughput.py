"""The update's model FLOPs, tokens per second per GPU, and the fraction of the card's bf16 peak.

Model FLOPs count what the computation needs, not what the kernels happen to do (no padding, no
recomputation by gradient checkpointing), as PaLM's MFU does. For a sequence of `L` real tokens
of which the last `C` are the completion, with `N` the base model's parameters outside the
embedding and the output head, `H` the head's (hidden x vocabulary, tied or not), `R` the LoRA
adapter's, `l` layers and `a` the attention width (heads x head size):

* forward, per sequence: `2 (N + R) L + 2 H C + A`, where `A = 2 l a L (L + 1)` is causal
  attention (query-key scores and the weighted values, `4 a p` at position `p`, summed over
  positions) and the head runs on the completion only (the update keeps those logits alone);
* a scoring pass (reference or old log-probs, no gradients): the forward; the reference has no
  adapter (`R = 0`);
* a trained sequence (forward and backward): `4 N L + 6 R L + 4 H C + 3 A`. The backward
  computes the gradients of the activations (the forward's FLOPs again) and the weight gradients
  of the adapter alone (`2 R L`): the base model is frozen, so the `6 N` per token of full
  fine-tuning would count `2 N L` of work a LoRA update never does.

The fraction of the peak is the model FLOPs / (seconds x GPUs x the card's dense bf16 peak);
a card missing from `PEAK_BF16` gets tokens per second and no fraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from NVIDIA's data sheets. Matched in
# order against the name torch reports (`torch.cuda.get_device_name`), so the specific forms
# (NVL, PCIe) come before the general one.
PEAK_BF16: list[tuple[str, float]] = [
    ("H200 NVL", 835.5e12),
    ("H200", 989.5e12),  # SXM
    ("H100 NVL", 835.5e12),
    ("H100 PCIe", 756.5e12),
    ("H100", 989.5e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312e12),  # SXM and PCIe
]


def peak_flops(card: str) -> float | None:
    """The dense bf16 peak of the card named `card`, or None for a card (or CPU) not listed.

    >>> peak_flops("NVIDIA H100 80GB HBM3"), peak_flops("NVIDIA H100 PCIe"), peak_flops("NVIDIA H200")
    (989500000000000.0, 756500000000000.0, 989500000000000.0)
    >>> peak_flops("NVIDIA A100-SXM4-80GB"), peak_flops("cpu") is None
    (312000000000000.0, True)
    """
    for key, peak in PEAK_BF16:
        if key.lower() in card.lower():
            return peak
    return None


@dataclass(frozen=True)
class ModelCounts:
    """What the FLOPs formula needs of a model (see the module docstring)."""

    body: int  # N: parameters outside the input embedding and the output head
    head: int  # H: the output head's weights (hidden x vocabulary)
    adapter: int  # R: trainable (LoRA) parameters
    layers: int  # l
    attention: int  # a: heads x head size

    @classmethod
    def of(cls, model: Any) -> ModelCounts:
        """Counted on a (PEFT-wrapped) transformers causal LM."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        skip = {id(embed), id(head)}
        body = adapter = 0
        for p in model.parameters():
            if id(p) in skip:
                continue
            if p.requires_grad:
                adapter += p.numel()
            else:
                body += p.numel()
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(body, head.numel(), adapter, config.num_hidden_layers, heads * head_dim)

    def attention_flops(self, length: int) -> float:
        """`A` of a sequence of `length` tokens (forward, causal)."""
        return 2.0 * self.layers * self.attention * length * (length + 1)

    def forward_flops(self, prompt: int, completion: int, adapter: bool = True) -> float:
        """One forward over a sequence, keeping the completion's logits (a scoring pass)."""
        length = prompt + completion
        params = self.body + (self.adapter if adapter else 0)
        return 2.0 * params * length + 2.0 * self.head * completion + self.attention_flops(length)

    def train_flops(self, prompt: int, completion: int) -> float:
        """Forward and backward over a sequence, the adapter's weight gradients included.

        >>> m = ModelCounts(body=100, head=10, adapter=1, layers=0, attention=0)
        >>> m.train_flops(3, 2)  # 4*100*5 + 6*1*5 + 4*10*2
        2110.0
        >>> m.forward_flops(3, 2), m.forward_flops(3, 2, adapter=False)  # 2*101*5 + 2*10*2, 2*100*5 + 40
        (1050.0, 1040.0)
        """
        length = prompt + completion
        return (
            4.0 * self.body * length
            + 6.0 * self.adapter * length
            + 4.0 * self.head * completion
            + 3.0 * self.attention_flops(length)
        )

    def pass_flops(self, lengths: Sequence[tuple[int, int]], kind: str) -> float:
        """The model FLOPs of one pass over sequences of (prompt, completion) tokens: `train`,
        `score` (with the adapter) or `reference` (without)."""
        if kind == "train":
            return sum(self.train_flops(p, c) for p, c in lengths)
        return sum(self.forward_flops(p, c, adapter=kind == "score") for p, c in lengths)


def part_figures(
    name: str, flops: float, tokens: int, seconds: float, gpus: int, peak: float | None
) -> dict[str, float]:
    """`perf/update_<name>_*` figures of one part of the update: its model TFLOPs, tokens per
    second per GPU and, on a listed card, the fraction of the peak.

    >>> part_figures("train", 4e15, 100_000, 2.0, 2, 1e15)
    {'perf/update_train_tflop': 4000.0, 'perf/update_train_tokens_per_s_per_gpu': 25000.0, 'perf/update_train_peak_fraction': 1.0}
    >>> part_figures("ref", 1e12, 10, 0.0, 1, None)
    {'perf/update_ref_tflop': 1.0}
    """
    out = {f"perf/update_{name}_tflop": flops / 1e12}
    if seconds <= 0:
        return out
    out[f"perf/update_{name}_tokens_per_s_per_gpu"] = tokens / seconds / gpus
    if peak:
        out[f"perf/update_{name}_peak_fraction"] = flops / seconds / gpus / peak
    return out


def counts_of(policy: Any) -> ModelCounts | None:
    """The policy's model counts, or None for a policy that is not a transformers model."""
    model = getattr(policy, "model", None)
    try:
        return ModelCounts.of(model)
    except (AttributeError, TypeError):
        return None


def card_of(device: str) -> str:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def update_figures(
    policy: Any,
    lengths: Sequence[tuple[int, int]],
    *,
    iterations: int,
    seconds: dict[str, float],
    gpus: int,
    scored_old: bool,
    scored_ref: bool,
) -> dict[str, float]:
    """The update's `perf/*` figures: per part (`ref`, `old`: scoring passes; `train`: forward and
    backward) and for the whole update (`seconds["total"]`, optimizer steps and scoring
    included). `lengths`: the trained samples' (prompt, completion) tokens; `seconds`: the parts'."""
    counts = counts_of(policy)
    if counts is None:
        return {}
    peak = peak_flops(card_of(policy.device))
    tokens = sum(p + c for p, c in lengths)
    out: dict[str, float] = {}
    total = 0.0
    parts = [("train", "forward_backward", "train", iterations)]
    if scored_old:
        parts.append(("old", "old", "score", 1))
    if scored_ref:
        parts.append(("ref", "ref", "reference", 1))
    for name, timed, kind, times in parts:
        flops = times * counts.pass_flops(lengths, kind)
        total += flops
        out.update(part_figures(name, flops, times * tokens, seconds.get(timed, 0.0), gpus, peak))
    whole = part_figures("all", total, iterations * tokens, seconds["total"], gpus, peak)
    # The whole update's figures without a part's name: the trained tokens per second per GPU.
    out.update({key.replace("update_all_", "update_"): value for key, value in whole.items()})
    return out
