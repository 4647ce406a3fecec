"""Streamed rollouts against the real sandbox: a completion's program runs while later completions
are still being generated, and every sample keeps its place, result and reward (and what a length
penalty took off it)."""

from __future__ import annotations

import asyncio

import pytest
from crucible_shared.jobs import DataSpec, RewardSpec
from crucible_shared.openai_protocol import CompletionLogProbs, CompletionResponseChoice
from crucible_shared.sandbox_client import SandboxClient
from crucible_trainer.methods.groups import (
    assign_group_advantages,
    informative,
    worth_training,
    zero_signal_metrics,
)
from crucible_trainer.rl.rollout import Prompt, Roller, Timing
from crucible_trainer.tasks import load_tasks

LOOP = "def loop():\n    while True:\n        pass\nloop()\n"


class Spy(SandboxClient):
    """The real client, noting each batch it sends."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.batches: list[list[str]] = []
        self.sent = asyncio.Event()

    async def run_batch(self, runs):
        self.batches.append([r.code for r in runs])
        self.sent.set()
        return await super().run_batch(runs)


class Generator:
    """Streams `texts` as the choices of one request (two prompts, n=2): the last only once the
    sandbox has received a batch, as a generator still decoding would, or fails (`hold_s`)."""

    def __init__(self, texts: list[str], sandbox: Spy, hold_s: float = 10.0) -> None:
        self.texts, self.sandbox, self.hold_s = texts, sandbox, hold_s

    async def complete_stream(self, prompts, *, n, **kw):
        order = [2, 0, 1, 3]  # finishing order, not index order
        for k, i in enumerate(order):
            if k == len(order) - 1:
                await asyncio.wait_for(self.sandbox.sent.wait(), self.hold_s)
            ids = list(range(5 + i))
            yield CompletionResponseChoice(
                index=i, text=self.texts[i], token_ids=ids, prompt_token_ids=[1, 2],
                logprobs=CompletionLogProbs(token_logprobs=[-0.5] * len(ids)), finish_reason="stop",
            )  # fmt: skip


def test_programs_run_while_later_completions_decode(sandbox):
    time_limit_s = 2.0
    tasks = load_tasks(DataSpec(dataset="mbpp", split="train", limit=2))
    right = [t.reference for t in tasks]
    texts = [right[0], "def nothing(): pass\n", LOOP, right[1]]

    async def go():
        async with Spy(sandbox.url) as spy:
            roller = Roller(Generator(texts, spy), spy, tasks, RewardSpec(kind="all_pass", time_limit_s=time_limit_s),
                            extract=lambda text, task: text)  # fmt: skip
            prompts = [Prompt(task_index=0, group=0, text="a"), Prompt(task_index=1, group=1, text="b")]
            timing = Timing()
            out = await roller.roll(prompts, model="m", n=2, temperature=1.0, top_p=1.0, max_tokens=8, seed=0,
                                    timing=timing)  # fmt: skip
            return out, spy.batches, timing

    out, batches, timing = asyncio.run(go())
    # Three programs were sent before the fourth completion existed; it went in a batch of its own.
    assert sum(len(b) for b in batches) == 4 and batches[-1] == [tasks[1].program(right[1])]
    assert [x.text for x in out] == texts  # prompt-major order, as the request numbered them
    assert [x.task_index for x in out] == [0, 0, 1, 1] and [x.group for x in out] == [0, 0, 1, 1]
    assert [x.reward for x in out] == [1.0, 0.0, 0.0, 1.0]
    assert out[2].result.status.value == "timeout"
    assert out[3].completion_ids == [0, 1, 2, 3, 4, 5, 6, 7] and out[3].gen_logprobs == [-0.5] * 8
    # The loop ran to its limit during "generation": it is not in the tail after the last completion.
    assert timing.execute_busy_s >= time_limit_s


def roll_one_prompt(sandbox_url: str, generator) -> None:
    """One prompt of an MBPP task, two samples, rolled with `generator` against the real sandbox."""
    tasks = load_tasks(DataSpec(dataset="mbpp", split="train", limit=1))

    async def go():
        async with SandboxClient(sandbox_url) as client:
            roller = Roller(generator, client, tasks, RewardSpec(), extract=lambda text, task: text)
            prompt = Prompt(task_index=0, group=0, text="a")
            await roller.roll([prompt], model="m", n=2, temperature=1.0, top_p=1.0, max_tokens=8, seed=0)

    asyncio.run(go())


def first_choice(text: str) -> CompletionResponseChoice:
    return CompletionResponseChoice(
        index=0, text=text, token_ids=[1], prompt_token_ids=[1], finish_reason="stop"
    )


def test_a_generator_that_fails_mid_stream_fails_the_rollout(sandbox):
    class Broken:
        async def complete_stream(self, prompts, **kw):
            yield first_choice(LOOP)
            raise RuntimeError("generator gone")

    with pytest.raises(RuntimeError, match="generator gone"):
        roll_one_prompt(sandbox.url, Broken())


def test_a_stream_short_of_completions_fails_the_rollout(sandbox):
    """A stream that ends (`[DONE]`) before every choice came fails the step rather than leaving a
    group short of samples, whose baseline would then be another group's."""

    class Short:
        async def complete_stream(self, prompts, **kw):
            yield first_choice("x = 1\n")

    with pytest.raises(RuntimeError, match="streamed 1 of 2 completions"):
        roll_one_prompt(sandbox.url, Short())


def test_a_length_penalty_is_centred_but_never_sets_a_groups_scale(sandbox):
    """Rolled against the real sandbox with a length penalty: a group whose programs all pass keeps
    only its centred penalty (a hundredth, not ±1 from dividing the penalty by its own spread);
    a group that splits is scaled by its tests' spread; only it is informative."""
    tasks = load_tasks(DataSpec(dataset="mbpp", split="train", limit=2))
    right = [t.reference for t in tasks]
    texts = [right[0], right[0], "def nothing(): pass\n", right[1]]  # 5, 6, 7 and 8 tokens

    async def go():
        async with Spy(sandbox.url) as spy:
            spec = RewardSpec(kind="all_pass", length_penalty=1.0)  # 0.01 a token
            roller = Roller(Generator(texts, spy), spy, tasks, spec, extract=lambda text, task: text)
            prompts = [Prompt(task_index=0, group=0, text="a"), Prompt(task_index=1, group=1, text="b")]
            return await roller.roll(
                prompts, model="m", n=2, temperature=1.0, top_p=1.0, max_tokens=8, seed=0
            )

    out = asyncio.run(go())
    assert [x.reward for x in out] == pytest.approx([0.95, 0.94, -0.07, 0.92])
    assert [x.task_reward for x in out] == pytest.approx([1.0, 1.0, 0.0, 1.0])
    assign_group_advantages(out, "group")
    assert [x.advantage for x in out] == pytest.approx([0.005, -0.005, -0.99, 0.99], abs=1e-3)
    assert informative(out) == [1] and zero_signal_metrics(out)["zero_signal_groups"] == 1
    assert not worth_training(out[:2], "reward_spread") and worth_training(out[2:], "reward_spread")
