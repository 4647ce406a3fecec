"""What the fast path does not implement is detected and served by the eager path, with one log line
naming the feature, never a wrong answer (crucible_generator/features.py).

One test per reason: the model-level reasons on configs of the families that have them (and, for
sliding windows, on a served model, where skipping the check would change the answer), the
adapter-level reasons on PEFT configs and, for the ones a user meets in practice, on adapters
served next to transformers + PEFT.
"""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
import torch
from crucible_generator.engine import Engine, SamplingParams
from crucible_generator.fastpath import LENGTH_BUCKET
from crucible_generator.features import adapter_gap, config_gap, model_gap, row_limit
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig

from tests.families import family_config, hf_greedy, hf_logits, hf_model, save_checkpoint

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
}


def bound(model_type: str, kernel: str = "sdpa", **values):
    """A config as a loaded model holds it (`_attn_implementation` set)."""
    config = AutoConfig.for_model(model_type, **{**TINY, **values})
    config._attn_implementation = kernel
    return config


# --- models -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (bound("llama", kernel="flex_attention"), "flex_attention attention kernel"),
        (bound("llama", kernel="flash_attention_2"), "flash_attention_2 attention kernel"),
        (AutoConfig.for_model("gemma3"), "multimodal model"),
        (bound("qwen3_next"), "linear_attention layers"),
        (bound("gemma3n_text", num_hidden_layers=4, num_kv_shared_layers=2), "shared across layers"),
        (bound("mistral", sliding_window=128), "sliding-window attention with a 128-token window"),
        (bound("gemma2", sliding_window=64), "sliding-window attention with a 64-token window"),
    ],
    ids=["flex", "flash", "multimodal", "linear-attention", "shared-kv", "mistral-window", "gemma2-window"],
)
def test_each_model_feature_the_fast_path_lacks_is_named(config, words):
    assert words in (config_gap(config, LENGTH_BUCKET) or "")


@pytest.mark.parametrize(
    "config",
    [
        bound("llama"),
        bound("llama", kernel="eager"),
        bound("gemma2", kernel="eager"),  # soft-capping: eager attention applies it under any mask
        bound("gemma3_text", sliding_window=512),  # a window of whole row buckets: rows are capped
        bound("qwen2", sliding_window=4096, use_sliding_window=False),
        bound("phi3", sliding_window=2047, head_dim=None),
    ],
    ids=["llama", "eager", "gemma2", "gemma3", "qwen2", "phi3"],
)
def test_features_the_fast_path_implements_are_not_refused(config):
    assert config_gap(config, LENGTH_BUCKET) is None


def test_rows_are_capped_at_a_sliding_window_in_whole_buckets():
    assert row_limit(bound("phi3", sliding_window=2047, head_dim=None), 256) == 1792
    assert row_limit(bound("gemma3_text", sliding_window=512), 256) == 512
    assert row_limit(bound("qwen2", sliding_window=4096, use_sliding_window=False), 256) is None
    assert row_limit(bound("llama"), 256) is None


def test_a_forward_without_logits_to_keep_is_refused():
    class OldStyle(torch.nn.Module):
        config = bound("llama")

        def forward(self, input_ids, attention_mask=None):
            return input_ids

    assert model_gap(OldStyle(), LENGTH_BUCKET) == "a forward without logits_to_keep"


def test_a_refused_model_is_served_eagerly_with_one_log_line(caplog):
    from transformers import AutoModelForCausalLM

    caplog.set_level(logging.INFO, logger="crucible_generator")
    model = AutoModelForCausalLM.from_config(bound("llama"), attn_implementation="flex_attention")
    engine = Engine(model, _Tokenizer(), fast_decode="on")
    assert engine.fast is None
    lines = [r.getMessage() for r in caplog.records if "fast decoding" in r.getMessage()]
    assert lines == ["fast decoding does not implement the flex_attention attention kernel (it does not "
                     "read the fast path's 4-D masks); this model uses the eager path"]  # fmt: skip


class _Tokenizer:
    pad_token_id, eos_token_id = 0, 1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def tokenizer():
    from crucible_models import load_tokenizer

    return load_tokenizer()


def windowed(tmp_path, tokenizer, window: int):
    """A tiny Mistral whose every layer slides over `window` tokens."""
    config = family_config("mistral", tokenizer)
    config.sliding_window = window
    return save_checkpoint(config, tmp_path / f"mistral-w{window}", tokenizer, seed=3)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def serve(path, **kw) -> Engine:
    import crucible_models as models

    model, tok = models.load_model(str(path), device="cpu", dtype="float32")
    engine = Engine(model, tok, max_batch_size=4, batch_wait_s=0.01, **kw)
    engine.start()
    return engine


def test_a_short_sliding_window_is_served_eagerly_and_right(tmp_path, tokenizer, caplog):
    from crucible_generator.continuous import ContinuousDecoder

    caplog.set_level(logging.INFO, logger="crucible_generator")
    path = windowed(tmp_path, tokenizer, 16)
    prompt = tokenizer.encode("def add(a, b):\n    return a + b\n\n# sum of squares of a list\n")[:28]
    want = hf_greedy(hf_model(path), prompt, 12)  # the window matters: 28 + 12 tokens > 16
    engine = serve(path, fast_decode="on")
    try:
        assert engine.fast is None
        assert asyncio.run(engine.generate([prompt], greedy(12)))[0].token_ids == want
    finally:
        engine.stop()
    assert (
        sum("sliding-window attention with a 16-token window" in r.getMessage() for r in caplog.records) == 1
    )
    # Why: the fast path's masks span whole rows, so taking this model would change its answer.
    decoder = ContinuousDecoder(hf_model(path), rows=1, length=LENGTH_BUCKET, use_graphs=False)
    got = []
    with torch.no_grad():
        logits, _ = decoder.prefill([0], [prompt])
        for _ in range(12):
            got.append(int(logits[0].argmax()))
            decoder.feed(torch.tensor([0]), torch.tensor([got[-1]]))
            logits = decoder.step((1, LENGTH_BUCKET))
    assert got[:1] == want[:1] and got != want


def test_requests_longer_than_a_capped_row_take_the_eager_path_and_stay_right(tmp_path, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="crucible_generator")
    path = windowed(tmp_path, tokenizer, 300)  # rows hold 256 tokens
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n" * 40)
    reference = hf_model(path)
    engine = serve(path, fast_decode="on")
    try:
        assert engine.fast is not None and engine.fast.length == 256
        # 290 + 24 tokens: past the row, and past the window (the answer's end slides).
        for prompt, fast in ((ids[:20], True), (ids[:290], False)):
            assert engine.continuous is not None and engine.continuous.fits(_Seq(prompt, 24)) is fast
            got = asyncio.run(engine.generate([prompt], greedy(24)))[0].token_ids
            assert got == hf_greedy(reference, prompt, 24)
    finally:
        engine.stop()
    assert sum("rows hold at most 256 tokens" in r.getMessage() for r in caplog.records) == 1
    # Why: rows longer than the window would attend past it (the fast path's masks span rows).
    from crucible_generator.continuous import ContinuousDecoder

    decoder = ContinuousDecoder(reference, rows=1, length=2 * LENGTH_BUCKET, use_graphs=False)
    with torch.no_grad():
        unwindowed = decoder.prefill([0], [ids[:310]])[0][0]
    windowed_logits = hf_logits(reference, ids[:310])[-1]
    assert not torch.allclose(unwindowed, windowed_logits, atol=1e-3)


class _Seq:
    def __init__(self, prompt: list[int], max_tokens: int) -> None:
        self.prompt_ids, self.params = prompt, SamplingParams(max_tokens=max_tokens)


# --- adapters -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (LoraConfig(modules_to_save=["lm_head"]), "modules_to_save"),
        (LoraConfig(trainable_token_indices=[1, 2]), "trainable token embeddings"),
        (LoraConfig(target_parameters=["mlp.experts.gate_up_proj"]), "LoRA on parameters"),
        (LoraConfig(layer_replication=[[0, 2], [1, 2]]), "replicated layers"),
        (LoraConfig(alora_invocation_tokens=[5, 6]), "activated LoRA"),
        (LoraConfig(lora_bias=True), "LoRA biases"),
        (LoraConfig(use_dora=True), "DoRA"),
        (LoraConfig(bias="all"), "trained biases (bias='all')"),
        (LoraConfig(bias="lora_only"), "trained biases (bias='lora_only')"),
        (None, "an adapter PEFT does not know"),
    ],
    ids=["modules_to_save", "trainable-tokens", "target-parameters", "layer-replication", "alora",
         "lora-bias", "dora", "bias-all", "bias-lora-only", "unknown"],
)  # fmt: skip
def test_each_adapter_feature_merging_would_drop_is_named(config, words):
    assert words in (adapter_gap(config, {}, "default", set()) or "")
    assert adapter_gap(LoraConfig(), {}, "default", set()) is None


class _Layer:
    """What `adapter_gap` reads of a PEFT LoRA layer."""

    def __init__(self, base: torch.nn.Module, variant: object | None = None) -> None:
        self.base, self.lora_variant = base, {"default": variant} if variant is not None else {}

    def get_base_layer(self) -> torch.nn.Module:
        return self.base


class DoraLikeVariant:
    pass


def test_layers_merging_would_get_wrong_are_named():
    plain = LoraConfig()
    linear = torch.nn.Linear(4, 4)
    assert adapter_gap(plain, {"q_proj": _Layer(linear)}, "default", set()) is None
    variant = {"q_proj": _Layer(linear, DoraLikeVariant())}
    assert adapter_gap(plain, variant, "default", set()) == "a LoRA variant (DoraLikeVariant)"
    no_weight = {"block": _Layer(torch.nn.ReLU())}
    assert adapter_gap(plain, no_weight, "default", set()) == "LoRA on ReLU layers"
    tied = {"model.embed_tokens": _Layer(torch.nn.Embedding(4, 4))}
    assert "tied embeddings" in adapter_gap(plain, tied, "default", {"model.embed_tokens", "lm_head"})


class Served:
    """A family checkpoint served by a fast-path engine, and PEFT + transformers as the reference."""

    def __init__(self, path, tokenizer) -> None:
        self.path, self.engine = path, serve(path, fast_decode="on")
        self.prompts = [tokenizer.encode(t) for t in ("def add(a, b):\n    return", "# sort a list\n")]

    def check(self, name: str, adapter_dir: str, merged: bool) -> None:
        """`adapter_dir` served as `name` answers as PEFT does, on merged weights or not."""
        asyncio.run(self.engine.load_adapter(name, adapter_dir))
        want = [hf_greedy(hf_model(self.path, adapter_dir), p, 12) for p in self.prompts]
        base = [hf_greedy(hf_model(self.path), p, 12) for p in self.prompts]
        for _ in range(2):  # the second batch finds the refusal cached (no second log line)
            got = asyncio.run(self.engine.generate(self.prompts, greedy(12), adapter=name))
            assert [c.token_ids for c in got] == want != base
        assert (self.engine.fast.merged.current == self.engine.adapters.slot(name)) is merged


def perturbed_adapter(path, out, config: LoraConfig, seed: int) -> str:
    """An adapter of `config` whose every trainable tensor (biases included) is random."""
    base = hf_model(path)
    peft = get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, param in peft.named_parameters():
            if param.requires_grad:
                param.normal_(0, 0.05)
    peft.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def qwen2(family_checkpoints, tokenizer):
    served = Served(family_checkpoints.get("qwen2"), tokenizer)  # q/k/v biases, untied embeddings
    yield served
    served.engine.stop()


@pytest.fixture(scope="module")
def llama_tied(family_checkpoints, tokenizer):
    served = Served(family_checkpoints.get("llama-tied"), tokenizer)
    yield served
    served.engine.stop()


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (LoraConfig(r=4, target_modules=ATTENTION, lora_bias=True), "LoRA biases"),
        (LoraConfig(r=4, target_modules=ATTENTION, modules_to_save=["lm_head"]), "modules_to_save"),
    ],
    ids=["lora-bias", "modules-to-save"],
)
def test_unmergeable_adapters_are_served_eagerly_and_right(qwen2, tmp_path, caplog, config, words):
    caplog.set_level(logging.INFO, logger="crucible_generator")
    qwen2.check(tmp_path.name, perturbed_adapter(qwen2.path, tmp_path / "a", config, seed=5), merged=False)
    assert sum(words in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_adapters_that_train_the_base_models_biases_are_refused(qwen2, tmp_path, bias):
    from crucible_generator.errors import BadRequest

    config = LoraConfig(r=4, target_modules=ATTENTION, bias=bias)
    adapter = perturbed_adapter(qwen2.path, tmp_path / "a", config, seed=8)
    with pytest.raises(BadRequest, match="trains the base model's biases") as info:
        asyncio.run(qwen2.engine.load_adapter(f"bias-{bias}", adapter))
    assert info.value.param == "lora_path"
    # The served model is untouched: the base still answers as transformers does.
    got = asyncio.run(qwen2.engine.generate(qwen2.prompts, greedy(12)))
    assert [c.token_ids for c in got] == [hf_greedy(hf_model(qwen2.path), p, 12) for p in qwen2.prompts]


def test_lora_on_embeddings_merges_when_untied(qwen2, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="crucible_generator")
    config = LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])
    qwen2.check("embed", perturbed_adapter(qwen2.path, tmp_path / "a", config, seed=6), merged=True)
    assert "does not merge" not in caplog.text


def test_lora_on_tied_embeddings_is_served_eagerly_and_right(llama_tied, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="crucible_generator")
    config = LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])
    adapter = perturbed_adapter(llama_tied.path, tmp_path / "a", config, seed=7)
    llama_tied.check("tied", adapter, merged=False)
    assert sum("tied embeddings" in r.getMessage() for r in caplog.records) == 1
