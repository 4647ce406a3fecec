"""The generator's adapter snapshot (`crucible_generator.adapter_files`): every file of an adapter
directory is checked, none is read through a link, no file's content reaches an error message,
and a load request's lengths and characters are capped with a 400."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from crucible_generator.adapter_files import check_load_request, snapshot_adapter
from crucible_generator.adapters import read_adapter_rank
from crucible_generator.errors import BadRequest, NotFound

SECRET = "SECRET-peft-type-0123456789"
SETTING = "CRUCIBLE_GENERATOR_ADAPTER_ROOTS"


@pytest.fixture
def store(tmp_path: Path) -> dict[str, Path]:
    root, outside = tmp_path / "adapters", tmp_path / "outside"
    adapter = root / "job" / "v1"
    adapter.mkdir(parents=True)
    outside.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    (outside / "secret.json").write_text(json.dumps({"peft_type": SECRET, "r": SECRET}))
    (outside / "weights").write_bytes(b"host weights")
    return {"root": root, "adapter": adapter, "outside": outside}


def test_a_clean_adapter_is_snapshotted(store) -> None:
    snap = snapshot_adapter("a-v1", str(store["adapter"]), [store["root"]], SETTING)
    try:
        assert sorted(p.name for p in snap.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert read_adapter_rank("a-v1", str(snap)) == 8
    finally:
        for p in snap.iterdir():
            p.unlink()
        snap.rmdir()


@pytest.mark.parametrize("linked", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_link_inside_the_adapter_is_refused_without_its_content(store, linked) -> None:
    (store["adapter"] / linked).unlink()
    target = "secret.json" if linked.endswith(".json") else "weights"
    (store["adapter"] / linked).symlink_to(store["outside"] / target)
    with pytest.raises(BadRequest) as caught:
        snapshot_adapter("a-v1", str(store["adapter"]), [store["root"]], SETTING)
    assert linked in str(caught.value) and "symbolic link" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_config_values_are_never_echoed(store) -> None:
    (store["adapter"] / "adapter_config.json").write_text(json.dumps({"peft_type": SECRET}))
    with pytest.raises(BadRequest) as caught:
        read_adapter_rank("a-v1", str(store["adapter"]))
    assert SECRET not in str(caught.value)
    (store["adapter"] / "adapter_config.json").write_text(json.dumps({"r": SECRET, "bias": SECRET}))
    with pytest.raises(BadRequest) as caught:
        read_adapter_rank("a-v1", str(store["adapter"]))
    assert SECRET not in str(caught.value)


def test_a_swapped_config_is_never_read_through_a_link(store) -> None:
    """Bounded race: the config flips between a file and a link to a host JSON; zero snapshots
    may hold the host file's content."""
    config, good = store["adapter"] / "adapter_config.json", b'{"peft_type": "LORA", "r": 8}'
    regular, link, stop = config.with_name(".r"), config.with_name(".l"), threading.Event()

    def swap() -> None:
        while not stop.is_set():
            regular.write_bytes(good)
            os.replace(regular, config)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(store["outside"] / "secret.json")
            os.replace(link, config)

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    leaks = loads = 0
    deadline = time.monotonic() + 1.5
    try:
        while time.monotonic() < deadline:
            try:
                snap = snapshot_adapter("a-v1", str(store["adapter"]), [store["root"]], SETTING)
            except (BadRequest, NotFound):
                continue
            loads += 1
            leaks += SECRET in (snap / "adapter_config.json").read_text()
            for p in snap.iterdir():
                p.unlink()
            snap.rmdir()
    finally:
        stop.set()
        thread.join()
    assert leaks == 0 and loads > 0, (leaks, loads)


def test_paths_outside_or_missing_are_4xx(store) -> None:
    with pytest.raises(BadRequest):
        snapshot_adapter("a-v1", str(store["outside"]), [store["root"]], SETTING)
    with pytest.raises(NotFound):
        snapshot_adapter("a-v1", str(store["root"] / "job" / "v9"), [store["root"]], SETTING)
    (store["root"] / "job" / "v2").symlink_to(store["adapter"], target_is_directory=True)
    with pytest.raises(BadRequest, match="symbolic link"):
        snapshot_adapter("a-v1", str(store["root"] / "job" / "v2"), [store["root"]], SETTING)


@pytest.mark.parametrize(
    ("name", "path", "param"),
    [
        ("a", "/x/" + "p" * 100_000, "lora_path"),
        ("n" * 1_000_000, "/x", "lora_name"),
        ("a\x1b[31m", "/x", "lora_name"),
        ("a\u202eb", "/x", "lora_name"),
        ("a", "/x\r\n", "lora_path"),
        ("base-model", "/x", "lora_name"),
    ],
)
def test_load_requests_are_capped(name, path, param) -> None:
    with pytest.raises(BadRequest) as caught:
        check_load_request(name, path, "base-model")
    assert caught.value.param == param
