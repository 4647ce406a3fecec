"""Every model family users train, on its tiny random checkpoint (tests/families.py), in-process:

* the generator's engine decodes transformers' greedy tokens with the fast path on (merged weights,
  row caches, packed attention, fused norms; no CUDA graphs on a CPU) and off, for the base model
  and with a rank-8 all-linear LoRA adapter (PEFT + transformers as the reference);
* hot-swap: v1, then v2 under a new name, answers follow the new weights; unloads;
* the offline merge (base + adapter folded into one model) gives PEFT's logits;
* a policy update trains the adapter, and the trained adapter, loaded into the engine, gives the
  log-probs the trainer computes (the stale-policy check).

The same families served over HTTP, trained and evaluated: tests/integration/test_families_served.py.
"""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
import torch
from crucible_generator.engine import Engine, SamplingParams
from crucible_shared.jobs import ModelSpec, OptimSpec, PublishSpec

from tests.families import FAMILIES, PROMPTS, hf_greedy, hf_logits, hf_model

pytestmark = pytest.mark.slow

TOKENS = 12
# The stale-policy check's tolerance (mean |log-prob difference| per token) is what the trainer
# accepts in a job; on a CPU in float32 both sides compute the same function much more closely.
STALE_TOLERANCE = PublishSpec().stale_tolerance
CLOSE = 1e-3


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


class Family:
    """One family's checkpoint, tokenized prompts, transformers' answers and two engines."""

    def __init__(self, name: str, checkpoints) -> None:
        import crucible_models as models

        self.name, self.dir = name, checkpoints.get(name)
        self.adapters = {v: checkpoints.adapter(name, v) for v in (1, 2)}
        model, tokenizer = models.load_model(str(self.dir), device="cpu", dtype="float32")
        self.engines = {}
        for mode, served in (("on", model), ("off", copy.deepcopy(model))):
            engine = Engine(served, tokenizer, max_batch_size=4, batch_wait_s=0.02, fast_decode=mode, seed=0)
            engine.start()
            self.engines[mode] = engine
        self.prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
        self._want: dict[int | None, list[list[int]]] = {}

    def want(self, version: int | None) -> list[list[int]]:
        """transformers' greedy tokens for the base (None) or with adapter `version`."""
        if version not in self._want:
            model = hf_model(self.dir, self.adapters[version] if version else None)
            self._want[version] = [hf_greedy(model, p, TOKENS) for p in self.prompts]
        return self._want[version]

    def generate(self, mode: str, adapter: str | None = None):
        return asyncio.run(self.engines[mode].generate(self.prompts, greedy(), adapter=adapter))

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, family_checkpoints):
    fam = Family(request.param, family_checkpoints)
    yield fam
    fam.close()


def tokens(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_greedy_tokens_equal_transformers_with_and_without_the_fast_path(family):
    fast = family.engines["on"]
    assert fast.fast is not None, f"{family.name}: the fast path refused the model"
    assert family.engines["off"].fast is None
    for mode in ("on", "off"):
        assert tokens(family.generate(mode)) == family.want(None), f"{family.name}, fast path {mode}"


def test_adapters_hot_swap_and_equal_peft(family, caplog):
    caplog.set_level(logging.INFO, logger="crucible_generator")
    for mode, engine in family.engines.items():
        asyncio.run(engine.load_adapter("v1", family.adapters[1]))
        got = tokens(family.generate(mode, "v1"))
        assert got == family.want(1) != family.want(None), f"{family.name}, fast path {mode}, v1"
        if mode == "on":  # the batch really ran on the merged weights, not on the eager fallback
            assert engine.fast.merged.current == engine.adapters.slot("v1")
        # The next version arrives under a new name; the old one leaves.
        asyncio.run(engine.load_adapter("v2", family.adapters[2]))
        asyncio.run(engine.unload_adapter("v1"))
        got = tokens(family.generate(mode, "v2"))
        assert got == family.want(2) != family.want(1), f"{family.name}, fast path {mode}, v2"
        asyncio.run(engine.unload_adapter("v2"))
        assert tokens(family.generate(mode)) == family.want(None)
    assert "does not merge" not in caplog.text and "does not implement" not in caplog.text


def test_merged_model_equals_base_plus_adapter(family, tmp_path):
    from crucible_trainer.offline.merge import merge_adapter

    out = merge_adapter(str(family.dir), family.adapters[1], tmp_path / "merged")
    ids = family.prompts[0] + family.want(1)[0]
    want = hf_logits(hf_model(family.dir, family.adapters[1]), ids)
    got = hf_logits(hf_model(out), ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_a_trained_adapter_serves_the_trainers_log_probs(family, tmp_path):
    """One policy update on the generator's own answers (advantages +1 and -1), the adapter saved and
    loaded into the engine under a new name: the generator's log-probs of the answers it gives then
    equal the trainer's, as the stale-policy check demands."""
    from crucible_trainer.rl.policy import Policy
    from crucible_trainer.rl.rollout import Sample
    from crucible_trainer.rl.update import UpdateConfig, update

    engine = family.engines["on"]
    spec = ModelSpec(base=str(family.dir), device="cpu", dtype="float32", init_adapter=family.adapters[1])
    policy = Policy(spec, OptimSpec(lr=0.05, warmup_steps=0))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    answers = family.generate("off")
    samples = [
        Sample(0, 0, prompt, c.token_ids, c.text, "", c.logprobs, "length", reward=r, advantage=r)
        for prompt, c, r in zip(family.prompts, answers, (1.0, -1.0), strict=True)
    ]
    metrics = update(policy, samples, UpdateConfig(micro_batch=2))
    assert metrics["grad_norm"] > 0 and all(
        not torch.equal(p, before[n]) for n, p in policy.model.named_parameters() if "lora_B" in n
    ), f"{family.name}: the update changed nothing"

    asyncio.run(engine.load_adapter("trained", str(policy.save_adapter(tmp_path / "v1"))))
    try:
        out = family.generate("on", "trained")
    finally:
        asyncio.run(engine.unload_adapter("trained"))
    scored = policy.score(family.prompts, tokens(out))
    for c, trainer in zip(out, scored, strict=True):
        diff = sum(abs(a - b) for a, b in zip(c.logprobs, trainer, strict=True)) / len(trainer)
        assert diff <= STALE_TOLERANCE, f"{family.name}: {diff:.5f} per token"
        assert diff <= CLOSE, f"{family.name}: {diff:.5f} per token"
