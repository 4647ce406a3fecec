"""Adapter bookkeeping: vLLM's errors, the `max_loras` bound (evicting the least recently used idle
adapter) and deferred unloading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from crucible_generator.adapters import AdapterRegistry, AdapterState
from crucible_generator.errors import BadRequest, InvalidUserInput, NotFound


def fake_adapter(folder: Path, rank: int = 8) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


def test_reserve_then_ready_is_served(tmp_path):
    registry = AdapterRegistry(max_loras=2, max_lora_rank=16)
    registry.reserve("job-v1", fake_adapter(tmp_path / "v1"))
    assert registry.served() == []
    registry.mark_ready("job-v1")
    assert [a.name for a in registry.served()] == ["job-v1"]


def test_same_name_twice_is_400(tmp_path):
    registry = AdapterRegistry(max_loras=2, max_lora_rank=16)
    path = fake_adapter(tmp_path / "v1")
    registry.reserve("job-v1", path)
    with pytest.raises(InvalidUserInput, match="already been loaded") as err:
        registry.reserve("job-v1", path)
    assert err.value.status == 400


def test_path_without_adapter_is_404(tmp_path):
    registry = AdapterRegistry(max_loras=2, max_lora_rank=16)
    with pytest.raises(NotFound, match="No adapter found for"):
        registry.reserve("job-v1", str(tmp_path / "missing"))


def test_rank_above_limit_is_400(tmp_path):
    registry = AdapterRegistry(max_loras=2, max_lora_rank=16)
    with pytest.raises(BadRequest, match="max_lora_rank 16"):
        registry.reserve("job-v1", fake_adapter(tmp_path / "v1", rank=32))


def test_max_loras_bound_gives_a_clear_error(tmp_path):
    registry = AdapterRegistry(max_loras=2, max_lora_rank=16)
    for v in (1, 2):
        registry.reserve(f"job-v{v}", fake_adapter(tmp_path / f"v{v}"))
    with pytest.raises(InvalidUserInput, match="max_loras=2"):
        registry.reserve("job-v3", fake_adapter(tmp_path / "v3"))


def test_unload_waits_for_in_flight_sequences(tmp_path):
    registry = AdapterRegistry(max_loras=2, max_lora_rank=16)
    registry.reserve("job-v1", fake_adapter(tmp_path / "v1"))
    registry.mark_ready("job-v1")
    registry.acquire("job-v1", 2)
    assert registry.begin_unload("job-v1") is False  # two sequences still decode with it
    with pytest.raises(NotFound):
        registry.acquire("job-v1", 1)  # but no new request gets it
    assert registry.release("job-v1") is False
    assert registry.release("job-v1") is True  # the last one out deletes it
    assert registry.counts()[AdapterState.unloading] == 1
    registry.forget("job-v1")
    assert registry.counts() == {"loading": 0, "ready": 0, "unloading": 0}


def test_unknown_unload_is_404():
    with pytest.raises(NotFound, match="cannot be found"):
        AdapterRegistry(max_loras=1, max_lora_rank=8).begin_unload("nope")


def test_each_load_gets_its_own_peft_slot(tmp_path):
    registry = AdapterRegistry(max_loras=3, max_lora_rank=16)
    slots = [registry.reserve(name, fake_adapter(tmp_path / name)).slot for name in ("a.1", "a.2")]
    assert len(set(slots)) == 2 and all("." not in slot for slot in slots)


def _ready(registry: AdapterRegistry, tmp_path: Path, name: str) -> None:
    registry.reserve(name, fake_adapter(tmp_path / name))
    registry.mark_ready(name)


def test_at_max_loras_the_least_recently_used_idle_adapter_makes_room(tmp_path):
    registry = AdapterRegistry(max_loras=3, max_lora_rank=16)
    for name in ("dead-job-v1", "live-v1"):
        _ready(registry, tmp_path, name)
    assert registry.evict_for_room() is None  # room left: nothing goes
    _ready(registry, tmp_path, "live-v2")
    registry.acquire("dead-job-v1", 1)  # used after the others were loaded...
    registry.release("dead-job-v1")
    registry.acquire("live-v2", 1)  # ...and live-v2 still decodes
    # live-v1 is idle and the least recently used: it goes, not the adapter in use.
    assert registry.evict_for_room() == "live-v1"
    with pytest.raises(NotFound):
        registry.acquire("live-v1", 1)  # no new request gets an evicted adapter
    registry.forget("live-v1")  # (the engine deletes its weights)
    registry.reserve("live-v3", fake_adapter(tmp_path / "live-v3"))  # and the load fits


def test_at_max_loras_with_every_adapter_in_use_the_load_is_refused(tmp_path):
    registry = AdapterRegistry(max_loras=2, max_lora_rank=16)
    for name in ("a-v1", "b-v1"):
        _ready(registry, tmp_path, name)
        registry.acquire(name, 1)
    assert registry.evict_for_room() is None
    with pytest.raises(InvalidUserInput, match="max_loras=2 adapters are already loaded and in use"):
        registry.reserve("c-v1", fake_adapter(tmp_path / "c-v1"))


def test_a_load_that_would_fail_is_refused_before_anything_is_evicted(tmp_path):
    registry = AdapterRegistry(max_loras=1, max_lora_rank=16)
    _ready(registry, tmp_path, "a-v1")
    with pytest.raises(BadRequest):
        registry.validate("big-v1", fake_adapter(tmp_path / "big", rank=64))
    with pytest.raises(InvalidUserInput, match="already been loaded"):
        registry.validate("a-v1", str(tmp_path / "a-v1"))
    assert [a.name for a in registry.served()] == ["a-v1"]
