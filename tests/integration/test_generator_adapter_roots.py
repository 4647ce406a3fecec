"""`POST /v1/load_lora_adapter` with `lora_path`s out of CRUCIBLE_GENERATOR_ADAPTER_ROOTS, written as
an attacker who reaches the generator would: a real adapter outside the roots, reached by an
absolute path, `..`, a symbolic link inside the roots; `/proc`; NUL. Before the roots existed the
first three loaded (200): the server read any adapter (and probed any path) it could see.

The test generator's roots are pytest's base temp dir (generator_fixtures.py); the adapter
outside is a copy under the system temp dir.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def load(url: str, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


@pytest.fixture(scope="module")
def outside(lora_dirs) -> Iterator[Path]:
    """A valid adapter outside the roots."""
    folder = Path(tempfile.mkdtemp(prefix="crucible-outside-"))
    shutil.copytree(lora_dirs["v1"], folder / "v1")
    yield folder / "v1"
    shutil.rmtree(folder)


def attacks(base: Path, outside: Path) -> dict[str, str]:
    link = base / f"link-{os.getpid()}"
    if not link.is_symlink():
        link.symlink_to(outside.parent, target_is_directory=True)
    return {
        "absolute": str(outside),
        "dot-dot": f"{base}/{os.path.relpath(outside, base)}",
        "link to a folder out": str(link / "v1"),
        "link, then dot-dot": f"{link}/../{link.name}/v1",
        "proc": "/proc/self/environ",
        "proc, cwd": f"/proc/self/cwd/{os.path.relpath(outside, os.getcwd())}",
        "NUL": f"{outside}\x00",
    }


@pytest.mark.parametrize(
    "attack",
    ["absolute", "dot-dot", "link to a folder out", "link, then dot-dot", "proc", "proc, cwd", "NUL"],
)
def test_lora_paths_out_of_the_roots_are_refused(generator, outside, tmp_path_factory, attack) -> None:
    base = tmp_path_factory.getbasetemp()
    name = f"attack-{attack.replace(' ', '-').replace(',', '')}-v1"
    r = load(generator.url, name, attacks(base, outside)[attack])
    assert r.status_code == 400, (attack, r.status_code, r.text)
    error = r.json()["error"]  # vLLM's shape
    assert error["type"] == "BadRequestError" and error["param"] == "lora_path" and error["code"] == 400
    assert error["message"].startswith(f"Loading lora {name} failed: ")
    if "link" in attack:
        assert "symbolic link" in error["message"] and f"link-{os.getpid()}" in error["message"]
    served = {m["id"] for m in httpx.get(f"{generator.url}/v1/models").json()["data"]}
    assert name not in served


def test_an_encoded_separator_names_nothing(generator, outside, tmp_path_factory) -> None:
    """`%2F` is not decoded: a literal name under the roots, with no adapter there (already so)."""
    base = tmp_path_factory.getbasetemp()
    encoded = f"{base}/" + os.path.relpath(outside, base).replace("/", "%2F")
    r = load(generator.url, "encoded-v1", encoded)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError", r.text


def test_adapters_inside_the_roots_still_load(generator, lora_dirs, tmp_path_factory) -> None:
    base = tmp_path_factory.getbasetemp()
    inner = base / f"inner-link-{os.getpid()}"
    if not inner.is_symlink():
        inner.symlink_to(lora_dirs["v1"], target_is_directory=True)  # a link that stays inside
    try:
        r = load(generator.url, "roots-plain-v1", lora_dirs["v1"])
        assert r.status_code == 200, r.text
        # No link below a root is followed, not even one that stays inside (it could be swapped).
        r = load(generator.url, "roots-link-v1", str(inner))
        assert r.status_code == 400 and "symbolic link" in r.json()["error"]["message"], r.text
    finally:
        for name in ("roots-plain-v1", "roots-link-v1"):
            httpx.post(f"{generator.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_load_requests_are_capped_with_a_400(generator, lora_dirs) -> None:
    for name, path, param in (
        ("long-path-v1", "/" + "p" * 100_000, "lora_path"),
        ("n" * 1_000_000, lora_dirs["v1"], "lora_name"),
        ("esc\x1b[2J-v1", lora_dirs["v1"], "lora_name"),
    ):
        r = load(generator.url, name, path)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
    served = httpx.get(f"{generator.url}/v1/models").json()["data"]
    base = served[0]["id"]
    r = load(generator.url, base, lora_dirs["v1"])
    assert r.status_code == 400 and "base model" in r.json()["error"]["message"], r.text


def test_a_corrupt_adapter_is_a_400_that_quotes_none_of_its_files(
    generator, lora_dirs, tmp_path_factory
) -> None:
    folder = tmp_path_factory.mktemp("corrupt") / "v1"
    shutil.copytree(lora_dirs["v1"], folder)
    (folder / "adapter_model.safetensors").write_bytes(b"SECRET-HEADER-" * 100)
    r = load(generator.url, "corrupt-v1", str(folder))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert "SECRET" not in r.text
