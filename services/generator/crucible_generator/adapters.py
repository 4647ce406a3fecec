"""Bookkeeping of LoRA adapters: which names are served, by how many sequences, and the limits.

An adapter goes `loading` -> `ready` -> `unloading` -> forgotten. Only `ready` adapters accept new
requests. At `max_loras`, loading one more evicts the least recently used adapter that no request
is using (a job that died never unloads its versions; they must not lock every later job out);
when every adapter is in use the load is refused. Unloading waits for the sequences still decoding with the adapter (its `refs`): whoever
drops the count to zero while the adapter is `unloading` deletes its weights. The registry holds no
weights and never touches torch; the engine does the loading and deleting. Thread-safe: the event
loop acquires and the engine thread releases.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from .errors import BadRequest, InvalidUserInput, NotFound

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterState(StrEnum):
    loading = "loading"
    ready = "ready"
    unloading = "unloading"


@dataclass
class Adapter:
    """One LoRA adapter known to the server."""

    name: str
    path: str
    rank: int
    slot: str  # the adapter's name inside PEFT: client names may hold characters PEFT refuses (".")
    state: AdapterState = AdapterState.loading
    refs: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    last_used: float = field(default_factory=time.monotonic)  # loaded or last given a request


def read_adapter_rank(name: str, path: str) -> int:
    """Check that `path` holds a PEFT LoRA adapter and return its largest rank.

    Raises `NotFound` (vLLM's answer) when there is no adapter at `path`, `BadRequest` when the
    adapter is not a LoRA adapter, trains the base model's biases, or its config is unreadable.
    """
    folder = Path(path).expanduser()
    config_file = folder / "adapter_config.json"
    if not config_file.is_file() or not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise NotFound(f"Loading lora {name} failed: No adapter found for {path}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        what = "not valid JSON" if isinstance(exc, ValueError) else exc.strerror
        raise BadRequest(f"Loading lora {name} failed: unreadable adapter_config.json ({what})") from None
    # Messages never quote the file's content: the file is the caller's to choose.
    if not isinstance(config, dict):
        raise BadRequest(f"Loading lora {name} failed: adapter_config.json is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise BadRequest(f"Loading lora {name} failed: adapter_config.json's peft_type is not LORA")
    bias = config.get("bias") or "none"
    if bias != "none":
        # PEFT loads such biases into the base model's own layers, shared by every adapter and by
        # the base: serving this adapter would change everyone else's answers.
        raise BadRequest(
            f"Loading lora {name} failed: the adapter trains the base model's biases (its bias is not "
            "'none'), which every other adapter and the base model share; train it with bias='none'",
            param="lora_path",
        )
    try:
        pattern = config.get("rank_pattern") or {}
        ranks = [int(config.get("r", 8)), *(int(r) for r in dict(pattern).values())]
    except (TypeError, ValueError):
        raise BadRequest(
            f"Loading lora {name} failed: adapter_config.json's r and rank_pattern must be integers",
            param="lora_path",
        ) from None
    return max(ranks)


class AdapterRegistry:
    """Names, states and reference counts of the adapters, bounded by `max_loras` and `max_lora_rank`."""

    def __init__(self, max_loras: int, max_lora_rank: int) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._adapters: dict[str, Adapter] = {}
        self._slots = itertools.count()
        self._lock = threading.Lock()

    def validate(self, name: str, path: str) -> int:
        """The rank of the adapter at `path`, or the error vLLM gives for loading it as `name`."""
        if not name or not path:
            raise InvalidUserInput("Both 'lora_name' and 'lora_path' must be provided.")
        rank = read_adapter_rank(name, path)
        if rank > self.max_lora_rank:
            raise BadRequest(
                f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.", param="lora_path"
            )
        with self._lock:
            self._check_new_name(name)
        return rank

    def _check_new_name(self, name: str) -> None:
        existing = self._adapters.get(name)
        if existing is not None and existing.state is AdapterState.unloading:
            raise InvalidUserInput(
                f"The lora adapter '{name}' is still being unloaded; use a new name for new weights."
            )
        if existing is not None:
            raise InvalidUserInput(
                f"The lora adapter '{name}' has already been loaded. Adapter names are versioned: "
                "load new weights under a new name."
            )

    def reserve(self, name: str, path: str, source: str | None = None) -> Adapter:
        """Claim `name` for a load of `path`, or raise the error vLLM gives for this request
        (`source`: the path the client named, if `path` is a copy of it)."""
        rank = self.validate(name, path)
        with self._lock:
            self._check_new_name(name)  # again: another load may have claimed it meanwhile
            active = [a for a in self._adapters.values() if a.state is not AdapterState.unloading]
            if len(active) >= self.max_loras:
                raise InvalidUserInput(
                    f"Cannot load lora adapter '{name}': max_loras={self.max_loras} adapters are already "
                    f"loaded and in use ({', '.join(sorted(a.name for a in active))}). Unload one first."
                )
            adapter = Adapter(name=name, path=source or path, rank=rank, slot=f"lora{next(self._slots)}")
            self._adapters[name] = adapter
            return adapter

    def evict_for_room(self) -> str | None:
        """At `max_loras`: start unloading the least recently used idle adapter and return its name
        (the caller deletes its weights); None when there is room or every adapter is in use."""
        with self._lock:
            active = [a for a in self._adapters.values() if a.state is not AdapterState.unloading]
            idle = [a for a in active if a.state is AdapterState.ready and a.refs == 0]
            if len(active) < self.max_loras or not idle:
                return None
            victim = min(idle, key=lambda a: a.last_used)
            victim.state = AdapterState.unloading
            return victim.name

    def mark_ready(self, name: str) -> None:
        with self._lock:
            self._adapters[name].state = AdapterState.ready
            self._adapters[name].last_used = time.monotonic()

    def forget(self, name: str) -> None:
        """Drop `name` entirely (after a failed load or once its weights are deleted)."""
        with self._lock:
            self._adapters.pop(name, None)

    def acquire(self, name: str, count: int) -> Adapter:
        """Count `count` new sequences on `name`; `NotFound` unless it is ready."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None or adapter.state is not AdapterState.ready:
                raise NotFound(f"The model `{name}` does not exist.", param="model")
            adapter.refs += count
            adapter.last_used = time.monotonic()
            return adapter

    def rebind(self, name: str, slot: str) -> None:
        """`name` (still loading) was loaded into the existing PEFT adapter `slot`."""
        with self._lock:
            self._adapters[name].slot = slot

    def path(self, name: str) -> str:
        with self._lock:
            return self._adapters[name].path

    def slot(self, name: str) -> str:
        """The PEFT name of adapter `name`."""
        with self._lock:
            return self._adapters[name].slot

    def release(self, name: str, count: int = 1) -> bool:
        """Uncount finished sequences; True when the caller must now delete the adapter's weights."""
        with self._lock:
            adapter = self._adapters[name]
            adapter.refs -= count
            return adapter.state is AdapterState.unloading and adapter.refs == 0

    def begin_unload(self, name: str) -> bool:
        """Stop serving `name`; True when no sequence uses it, i.e. the caller must delete it now."""
        if not name:
            raise InvalidUserInput("'lora_name' needs to be provided to unload a LoRA adapter.")
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None or adapter.state is not AdapterState.ready:
                raise NotFound(f"The lora adapter '{name}' cannot be found.")
            adapter.state = AdapterState.unloading
            return adapter.refs == 0

    def served(self) -> list[Adapter]:
        """Adapters that accept requests, oldest first."""
        with self._lock:
            return [a for a in self._adapters.values() if a.state is AdapterState.ready]

    def counts(self) -> dict[str, int]:
        """Number of adapters per state (for metrics)."""
        with self._lock:
            states = [a.state.value for a in self._adapters.values()]
        return {s.value: states.count(s.value) for s in AdapterState}
