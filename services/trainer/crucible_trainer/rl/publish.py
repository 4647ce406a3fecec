"""Publishing adapter versions to the generator replicas, and the stale-policy check.

Each version gets a new name `<job>-v<step><tag>` (vLLM caches by name: reusing one would serve
stale weights), `<tag>` being the run's (`channel.tag`: empty for a job's first run, `-r<token>`
for a later one), so two runs of a job never load or write the same name: a run resumed after its
job was taken from another run cannot meet that run's versions. Every save and load is fenced:
the save is gated by the run's lease (`channel.gate`), and the load carries the run's fencing
token (`fence`: Crucible's generator refuses a load whose token for the job is older than the
newest it has seen; vLLM ignores the field). After the broadcast load returns on every replica, rollouts switch to the new
name and versions older than the staleness window are unloaded, except those a rollout still in
flight samples from (overlapped rollouts, rl/ahead.py, `pin` / `release`): such a version is
unloaded when its last rollout ends.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from crucible_shared.generator_client import AdapterBroadcastError, GeneratorAPIError, GeneratorPool, samples

from crucible_trainer.rl.policy import Policy
from crucible_trainer.runtime.channel import JobChannel, Superseded


class StalePolicyError(RuntimeError):
    """The generator does not serve the policy the trainer holds for the version it samples from
    (or a sample claims a version that was not checked, rl/ahead.py)."""


@dataclass
class Publisher:
    pool: GeneratorPool
    adapter_dir: Path
    job_id: str
    window: int
    base_name: str
    live: list[str] = field(default_factory=list)
    current: str | None = None
    pins: Counter[str] = field(default_factory=Counter)  # rollouts in flight per version name
    channel: JobChannel = field(default_factory=JobChannel)  # the run's lease (none: in-process)

    def name(self, version: int) -> str:
        """This run's name of `version` (`<job>-v<step><tag>`)."""
        return f"{self.job_id}-v{version}{self.channel.tag}"

    def path(self, version: int) -> Path:
        return self.adapter_dir / self.job_id / f"v{version}{self.channel.tag}"

    async def load(self, name: str, path: Path) -> None:
        """Load on every replica, fenced by the run's token; `Superseded` when a generator has
        seen a newer run of this job."""
        self.channel.gate()
        token = self.channel.token
        fenced = {} if token is None else {"fence": {"key": self.job_id, "token": token}}
        try:
            await self.pool.load_adapter(name, str(path.resolve()), **fenced)
        except AdapterBroadcastError as exc:
            if any(isinstance(e, GeneratorAPIError) and e.param == "fence" for e in exc.failures.values()):
                raise Superseded(f"a newer run of {self.job_id} loads its versions: {exc}") from exc
            raise

    @property
    def model_name(self) -> str:
        """What rollouts should ask for: the newest loaded version, or the base model."""
        return self.current or self.base_name

    async def publish(self, policy: Policy, version: int) -> dict[str, float]:
        started = time.perf_counter()
        path = self.path(version)
        self.channel.gate()
        gated = () if self.channel.token is None else (self.channel.gate,)  # in-process: no lease
        await policy.call(policy.save_adapter, path, *gated)
        saved = time.perf_counter()
        name = self.name(version)
        await self.load(name, path)
        loaded = time.perf_counter()
        self.live.append(name)
        self.current = name
        await self._trim()
        return {
            "publish/save_s": saved - started,
            "publish/load_s": loaded - saved,
            "publish/total_s": time.perf_counter() - started,
        }

    async def _trim(self) -> None:
        """Unload the versions older than the window that no rollout in flight uses."""
        excess = len(self.live) - (self.window + 1)
        doomed = [n for n in self.live[: max(0, excess)] if not self.pins[n]]
        # Taken off the list before the first await: a release and a publish may trim at once.
        self.live = [n for n in self.live if n not in doomed]
        for old in doomed:
            await self.pool.unload_adapter(old, missing_ok=True)

    def pin(self, name: str) -> None:
        """A rollout samples from `name` from now on: keep it loaded until `release`."""
        self.pins[name] += 1

    async def release(self, name: str) -> None:
        """A rollout of `name` ended; unload it if it is outside the window and unused."""
        self.pins[name] -= 1
        if self.pins[name] <= 0:
            del self.pins[name]
            await self._trim()

    async def adopt(self, version: int, policy: Policy | None = None) -> None:
        """At a run's start: make the generators serve exactly `version` (0: nothing of this job),
        under this run's own name.

        Every version of the job the generators serve is unloaded first: versions an earlier run
        published after its checkpoint (this run publishes new weights for those steps), and every
        name of an earlier run (this run loads and trims its own). `policy` holds exactly
        `version`'s weights when the checkpoint is that version's (published from it, as any
        step's); otherwise the version's saved adapter is loaded under this run's name.
        """
        pattern = re.compile(rf"^{re.escape(self.job_id)}-v\d+(-r\d+)?$")
        for client in self.pool.clients:
            listing = await client.models()
            for card in listing.data:
                if pattern.match(card.id):
                    self.channel.gate()
                    await client.unload_adapter(card.id, missing_ok=True)
        self.live, self.current = [], None
        if version == 0:
            return
        if policy is not None:
            await self.publish(policy, version)
            return
        saved = [
            p
            for p in (self.adapter_dir / self.job_id).glob(f"v{version}*")
            if p.name == f"v{version}" or p.name.startswith(f"v{version}-r")
        ]
        if not saved:
            return
        name = self.name(version)
        await self.load(name, max(saved, key=lambda p: p.stat().st_mtime))
        self.live, self.current = [name], name

    async def retire_all(self) -> None:
        for name in self.live:
            await self.pool.unload_adapter(name, missing_ok=True)
        self.live, self.current = [], None


async def stale_check(
    pool: GeneratorPool, policy: Policy, model_name: str, probe_prompt: str, tokens: int = 24
) -> dict[str, float]:
    """Score a fixed probe with the generator (version `model_name`) and with the trainer's policy.

    The generator decodes the probe greedily and reports its log-probs; the trainer scores the
    same token ids with the current adapter and with the adapter disabled. A fresh generator is
    close to the policy; one still serving older weights is not (and may be closer to the base).
    """
    response = await pool.complete(
        probe_prompt,
        model=model_name,
        n=1,
        max_tokens=tokens,
        temperature=0.0,
        logprobs=0,
        return_token_ids=True,
    )
    s = samples(response)[0]
    comp, gen_lp = list(s.token_ids or []), list(s.logprobs or [])
    if not comp or len(gen_lp) != len(comp):
        return {"stale/diff": float("nan"), "stale/ok": 0.0}
    prompt_ids = list(s.prompt_token_ids or [])
    now = (await policy.call(policy.score, [prompt_ids], [comp]))[0]
    base = (await policy.call(policy.score, [prompt_ids], [comp], 16, True))[0]
    diff = sum(abs(a - b) for a, b in zip(now, gen_lp, strict=True)) / len(comp)
    diff_base = sum(abs(a - b) for a, b in zip(base, gen_lp, strict=True)) / len(comp)
    moved = sum(abs(a - b) for a, b in zip(now, base, strict=True)) / len(comp)
    return {"stale/diff": diff, "stale/diff_to_base": diff_base, "stale/policy_moved": moved}
