"""Reusing an unloaded adapter's PEFT modules for the next adapter of the same shape.

A trainer loads a new adapter version after every update and unloads an old one, always with the
same LoRA config. PEFT's `load_adapter` spends most of its time walking the model and injecting
fresh modules (about 0.5 s for SmolLM2's 210 linear layers on a GPU host); copying the new
weights into the modules of an unloaded version with an identical config takes a few
milliseconds. One such spare is kept; anything else unloaded is deleted and its memory freed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# Config fields that do not change the modules' shapes or how they compute.
_IRRELEVANT = {"base_model_name_or_path", "revision", "inference_mode", "task_type", "peft_version"}


def config_signature(path: str | Path) -> str | None:
    """A canonical form of the adapter's LoRA config, or None when it cannot be read."""
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    return json.dumps({k: v for k, v in config.items() if k not in _IRRELEVANT}, sort_keys=True)


def _slot_key(file_key: str, slot: str) -> str:
    """`...q_proj.lora_A.weight` in a saved adapter is `...q_proj.lora_A.<slot>.weight` in the model."""
    head, _, leaf = file_key.rpartition(".")
    return f"{head}.{slot}.{leaf}"


class SpareSlot:
    """One unloaded adapter's modules, kept for an adapter with the same config."""

    def __init__(self, slot: str, signature: str) -> None:
        self.slot, self.signature = slot, signature

    def fill(self, peft: Any, path: str | Path) -> bool:
        """Copy the adapter at `path` into this slot; False (nothing changed) if it does not fit."""
        from safetensors.torch import load_file

        weights = Path(path) / "adapter_model.safetensors"
        if not weights.is_file() or config_signature(path) != self.signature:
            return False
        params = {name: p for name, p in peft.named_parameters() if f".{self.slot}." in name}
        state = load_file(str(weights))
        targets = {}
        for key, tensor in state.items():
            target = params.get(_slot_key(key, self.slot))
            if target is None or target.shape != tensor.shape:
                return False
            targets[key] = target
        if len(targets) != len(params):
            return False
        with torch.no_grad():
            for key, target in targets.items():
                target.copy_(state[key], non_blocking=True)
        return True
