"""`model.base` names: a hub-shaped name is checked against a strict pattern (a final newline is
no hub id), is never resolved relative to the working directory, and no model name carries
control or bidirectional-override characters."""

from __future__ import annotations

import os

import pytest
from crucible_models import resolve_model_path
from crucible_shared.jobs import EvalJob, TrainJob, job_paths, looks_like_path
from pydantic import ValidationError


@pytest.mark.parametrize("name", ["org/model\n", "org/model\r\n", "model\n", "org/../x", "a/b/c", "./m"])
def test_names_that_are_not_exactly_hub_ids_are_paths(name) -> None:
    assert looks_like_path(name)


@pytest.mark.parametrize("name", ["org/model", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2"])
def test_hub_ids_stay_hub_ids(name) -> None:
    assert not looks_like_path(name)


def test_a_trailing_newline_sends_the_name_to_the_roots_check() -> None:
    spec = TrainJob.model_validate({"model": {"base": "org/model"}})
    assert [f for f, _, _ in job_paths(spec)] == []
    bad = TrainJob.model_construct(
        **{**spec.__dict__, "model": spec.model.model_copy(update={"base": "org/model\n"})}
    )
    assert [f for f, _, _ in job_paths(bad)] == ["model.base"]


@pytest.mark.parametrize("base", ["org/model\n", "m\x1b[31m", "m\u202eevil", "m\r\nforged: line"])
@pytest.mark.parametrize("kind", [TrainJob, EvalJob])
def test_control_characters_are_refused_in_model_names(kind, base) -> None:
    with pytest.raises(ValidationError, match="control"):
        kind.model_validate({"model": {"base": base}})


def test_hub_names_never_load_from_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("cwd-model") == "cwd-model"  # nothing there: a hub id
    (tmp_path / "cwd-model").mkdir()
    (tmp_path / "cwd-model" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="working directory"):
        resolve_model_path("cwd-model")
    os.makedirs(tmp_path / "org" / "model")
    with pytest.raises(FileNotFoundError, match="working directory"):
        resolve_model_path("org/model")


def test_decoded_code_is_never_cleaned_up(tmp_path) -> None:
    """A tokenizer whose config asks for WordPiece's clean-up of spaces (" ," -> ","), as one
    converted from a GGUF can: answers are code, so they decode exactly as sampled."""
    import json
    import shutil

    from crucible_models import load_tokenizer

    load_tokenizer().save_pretrained(tmp_path)
    shutil.copy(os.path.join(resolve_model_path("smollm2-135m-instruct"), "config.json"), tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(config | {"clean_up_tokenization_spaces": True})
    )
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.clean_up_tokenization_spaces is False
    code = "print('a , b ?', x .y, \"n't\")"
    assert tokenizer.decode(tokenizer.encode(code, add_special_tokens=False)) == code
