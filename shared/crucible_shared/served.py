"""Which base model the generators serve, and whether it is the one a job names.

One rule, used where the answer is needed: the trainer at a job's start (against the generators'
`/v1/models`) and the gateway at submission (against what live trainer workers last read there,
`keys.worker_served`). A job's `model.base` matches a served base model by its id, its root (the
path or hub id it was loaded from), or either's last path component, in any case.

>>> same_model("SmolLM2-135M-Instruct", "smollm2-135m-instruct", "/cache/SmolLM2-135M-Instruct")
True
>>> same_model("./models/tiny", "tiny-model", "/srv/models/tiny")
True
>>> same_model("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct", None)
False
"""

from __future__ import annotations

import os
from typing import Any

from crucible_shared.openai_protocol import ModelCard, ModelList

__all__ = ["base_cards", "describe", "same_model"]

# How often a trainer worker reads what its generators serve, and how old a reading the gateway
# still trusts (a generator restarted with another model is seen within this long).
REFRESH_S = 30.0
FRESH_S = 3 * REFRESH_S


def same_model(wanted: str, card_id: str, root: str | None) -> bool:
    """Whether `wanted` (a job's `model.base`) names the served model `card_id` loaded from `root`."""
    names = {card_id.lower()}
    if root:
        names |= {root.lower(), os.path.basename(root.rstrip("/")).lower()}
    candidates = {wanted.lower(), os.path.basename(wanted.rstrip("/")).lower()}
    if wanted.startswith(("/", ".", "~")):
        candidates.add(os.path.abspath(os.path.expanduser(wanted)).lower())
    return bool(names & candidates)


def base_cards(listing: ModelList) -> list[ModelCard]:
    """The base models of a `/v1/models` listing (cards without a parent; else its first card)."""
    return [card for card in listing.data if getattr(card, "parent", None) in (None, "")] or listing.data[:1]


def describe(cards: list[Any]) -> str:
    """`id (root)` of each card (a `ModelCard` or its JSON), for an error message."""
    out = []
    for card in cards:
        card_id, root = (card["id"], card.get("root")) if isinstance(card, dict) else (card.id, card.root)
        out.append(f"{card_id} ({root})" if root else card_id)
    return ", ".join(out)
