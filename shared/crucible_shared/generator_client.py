"""Async client of the generator, for every service that samples from the policy.

It speaks vLLM's OpenAI-compatible protocol, so the same code talks to `vllm serve --enable-lora`
on a GPU host and to Crucible's own generator elsewhere:

    async with GeneratorClient("http://localhost:8001") as gen:
        await gen.wait_ready()
        await gen.load_adapter("job42-v10", "/adapters/job42/v10")
        out = await gen.complete("def add(a, b):", model="job42-v10", n=4, max_tokens=128, logprobs=0)
        for s in samples(out):
            s.token_ids, s.logprobs  # what the trainer needs

Adapter loads and unloads retry on connection errors and 5xx answers; a retried load that finds
its name already loaded (the first attempt did land) counts as success. `GeneratorPool` broadcasts
loads to several replicas all-or-nothing: if one replica fails, the others unload again, and splits
a request of several prompts over its replicas (a training step's rollouts are one such request).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from crucible_shared import sse
from crucible_shared.openai_protocol import (
    ChatCompletionResponse,
    CompletionResponse,
    CompletionResponseChoice,
    ErrorInfo,
    ModelList,
    UsageInfo,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class GeneratorAPIError(Exception):
    """A non-2xx answer of the generator, parsed from vLLM's error body (current or legacy shape)."""

    def __init__(self, status: int, message: str, *, type: str = "", param: str | None = None) -> None:
        super().__init__(f"{status} {type}: {message}" if type else f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param

    @property
    def retryable(self) -> bool:
        return self.status in RETRY_STATUSES

    @property
    def already_loaded(self) -> bool:
        """vLLM's answer to loading a name that is loaded already."""
        return self.status == 400 and "already been loaded" in self.message


class AdapterBroadcastError(Exception):
    """A broadcast load failed on some replicas; the replicas that had loaded it were rolled back."""

    def __init__(
        self,
        lora_name: str,
        failures: dict[str, BaseException],
        rolled_back: list[str],
        rollback_failures: dict[str, BaseException],
    ) -> None:
        detail = "; ".join(f"{url}: {exc}" for url, exc in failures.items())
        super().__init__(f"loading adapter {lora_name!r} failed on {len(failures)} replica(s): {detail}")
        self.lora_name = lora_name
        self.failures = failures
        self.rolled_back = rolled_back
        self.rollback_failures = rollback_failures


def parse_error(status: int, content: bytes | str) -> GeneratorAPIError:
    """Turn an error body into a `GeneratorAPIError`.

    Understands vLLM's `{"error": {"message", "type", "param", "code"}}`, the older flat
    `{"object": "error", "message", ...}`, FastAPI's `{"detail": ...}` and plain text.
    """
    text = content.decode(errors="replace") if isinstance(content, bytes) else content
    try:
        body = json.loads(text)
    except ValueError:
        return GeneratorAPIError(status, text.strip() or f"HTTP {status}")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        info = body["error"]
    elif isinstance(body, dict) and "message" in body:
        info = body
    elif isinstance(body, dict) and "detail" in body:
        return GeneratorAPIError(status, str(body["detail"]))
    else:
        return GeneratorAPIError(status, text)
    try:
        parsed = ErrorInfo.model_validate({"code": status, "type": "", **info})
    except ValueError:
        return GeneratorAPIError(status, str(info.get("message", text)))
    return GeneratorAPIError(status, parsed.message, type=parsed.type, param=parsed.param)


@dataclass
class Sample:
    """One sampled completion, flattened from either response kind."""

    prompt_index: int
    index: int
    text: str
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    logprobs: list[float] | None
    finish_reason: str | None


def samples(response: CompletionResponse | ChatCompletionResponse, n: int | None = None) -> list[Sample]:
    """The choices of a response as `Sample`s (`n` = samples per prompt, to number prompts)."""
    out = []
    if isinstance(response, ChatCompletionResponse):
        for choice in response.choices:
            lps = None
            if choice.logprobs is not None and choice.logprobs.content is not None:
                lps = [c.logprob for c in choice.logprobs.content]
            out.append(
                Sample(
                    prompt_index=0,
                    index=choice.index,
                    text=choice.message.content or "",
                    token_ids=choice.token_ids,
                    prompt_token_ids=response.prompt_token_ids,
                    logprobs=lps,
                    finish_reason=choice.finish_reason,
                )
            )
        return out
    return [sample_of(completion, n) for completion in response.choices]


def sample_of(completion: CompletionResponseChoice, n: int | None = None) -> Sample:
    """One completion choice as a `Sample` (`n` = samples per prompt, to number its prompt)."""
    lps = None
    if completion.logprobs is not None:
        lps = [lp if lp is not None else float("nan") for lp in completion.logprobs.token_logprobs]
    return Sample(
        prompt_index=completion.index // n if n else 0,
        index=completion.index,
        text=completion.text,
        token_ids=completion.token_ids,
        prompt_token_ids=completion.prompt_token_ids,
        logprobs=lps,
        finish_reason=completion.finish_reason,
    )


def fold(into: dict[str, Any] | None, delta: dict[str, Any]) -> dict[str, Any]:
    """A streamed choice so far (`into`, None at its first event) grown by its next event's
    `delta`: text, token ids and logprobs appended, the latest finish and stop reasons kept.

    >>> a = fold(None, {"index": 1, "text": "de", "token_ids": [5], "logprobs": {"tokens": ["de"],
    ...     "token_logprobs": [-0.5], "text_offset": [0], "top_logprobs": [None]}, "finish_reason": None})
    >>> b = fold(a, {"index": 1, "text": "f", "token_ids": [6], "logprobs": {"tokens": ["f"],
    ...     "token_logprobs": [-0.1], "text_offset": [2], "top_logprobs": [None]}, "finish_reason": "stop"})
    >>> b["text"], b["token_ids"], b["logprobs"]["token_logprobs"], b["finish_reason"]
    ('def', [5, 6], [-0.5, -0.1], 'stop')
    """
    if into is None:  # events are fresh from the JSON parser: the first one becomes the choice
        return delta
    into["text"] = into.get("text", "") + delta.get("text", "")
    if delta.get("token_ids") is not None:  # appended in place: a long choice is not copied per token
        into["token_ids"] = into.get("token_ids") or []
        into["token_ids"].extend(delta["token_ids"])
    if delta.get("prompt_token_ids") is not None:
        into["prompt_token_ids"] = delta["prompt_token_ids"]
    if delta.get("logprobs"):
        mine = into["logprobs"] = into.get("logprobs") or {}
        for key, values in delta["logprobs"].items():
            mine[key] = mine.get(key) or []
            mine[key].extend(values or [])
    for key in ("finish_reason", "stop_reason"):
        if delta.get(key) is not None:
            into[key] = delta[key]
    return into


def _drop_none(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


class GeneratorClient:
    """One generator replica (Crucible's server or vLLM) at `base_url`."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        retries: int = 3,
        backoff: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, headers=headers, transport=transport
        )

    async def __aenter__(self) -> GeneratorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- plumbing --------------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, *, json_body: Any = None, retries: int | None = None
    ) -> httpx.Response:
        """Send with retries on connection errors and 429/5xx; raise `GeneratorAPIError` on failure."""
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                response = await self._http.request(method, path, json=json_body)
            except httpx.TransportError as exc:
                if last:
                    raise
                log.warning("%s %s%s failed (%s); retrying", method, self.base_url, path, exc)
            else:
                if response.is_success:
                    return response
                error = parse_error(response.status_code, response.content)
                if last or not error.retryable:
                    raise error
                log.warning("%s %s%s answered %s; retrying", method, self.base_url, path, error)
            await asyncio.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")

    # --- health and models -----------------------------------------------------------------------

    async def health(self) -> bool:
        """True when `/health` answers 200."""
        try:
            response = await self._http.get("/health", timeout=5.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> None:
        """Poll `/health` until it answers 200; `TimeoutError` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"generator at {self.base_url} not ready after {timeout:.0f}s")
            await asyncio.sleep(interval)

    async def models(self) -> ModelList:
        response = await self._request("GET", "/v1/models")
        return ModelList.model_validate(response.json())

    # --- generation ------------------------------------------------------------------------------

    async def complete(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        *,
        model: str | None = None,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        return_token_ids: bool = True,
        **extra: Any,
    ) -> CompletionResponse:
        """`POST /v1/completions`; `logprobs=0` gives each sampled token's logprob."""
        body = _drop_none(
            dict(
                model=model,
                prompt=prompt,
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop=stop,
                seed=seed,
                logprobs=logprobs,
                return_token_ids=return_token_ids,
                **extra,
            )
        )
        response = await self._request("POST", "/v1/completions", json_body=body)
        return CompletionResponse.model_validate(response.json())

    async def complete_stream(
        self, prompt: str | list[str] | list[int] | list[list[int]], **kwargs: Any
    ) -> AsyncIterator[CompletionResponseChoice]:
        """`complete` streamed (`stream: true`): yields each choice whole as soon as it finishes,
        in the order they finish (vLLM sends a choice token by token, Crucible's generator in one
        event when it is done; both are folded here), so that a caller can act on the first
        answers while the rest still decode. Each index comes once: a stream that breaks is asked
        again and yields only the choices not yet yielded. A server that will not stream (400 on
        `stream`) is asked once without, and its choices come at the end."""
        body = _drop_none({"prompt": prompt, "return_token_ids": True, **kwargs, "stream": True})
        given: set[int] = set()
        for attempt in range(1 + self.retries):
            try:
                async for choice in self._stream_once(body):
                    if choice.index not in given:
                        given.add(choice.index)
                        yield choice
                return
            except GeneratorAPIError as exc:
                if exc.status == 400 and exc.param == "stream" and not given:
                    for choice in (await self.complete(prompt, **kwargs)).choices:
                        yield choice
                    return
                if not exc.retryable or attempt == self.retries:
                    raise
                log.warning("streamed completion at %s answered %s; retrying", self.base_url, exc)
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise
                log.warning("streamed completion at %s broke (%s); retrying", self.base_url, exc)
            await asyncio.sleep(self.backoff * 2**attempt)

    async def _stream_once(self, body: dict[str, Any]) -> AsyncIterator[CompletionResponseChoice]:
        """One streamed request: each choice once its event with a `finish_reason` came."""
        partial: dict[int, dict[str, Any]] = {}
        async with self._http.stream("POST", "/v1/completions", json=body) as response:
            if not response.is_success:
                raise parse_error(response.status_code, await response.aread())
            async for line in sse.alines(response.aiter_bytes()):  # not aiter_lines: see sse.py
                data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if data == "[DONE]":
                    return
                event = json.loads(data) if data else {}
                if isinstance(event.get("error"), dict):  # an error while decoding, after the 200
                    raise parse_error(int(event["error"].get("code") or 500), data)
                for delta in event.get("choices") or []:
                    choice = partial[delta["index"]] = fold(partial.get(delta["index"]), delta)
                    if choice.get("finish_reason") is not None:
                        yield CompletionResponseChoice.model_validate(partial.pop(delta["index"]))
        raise httpx.RemoteProtocolError("the stream ended before [DONE]")

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str | None = None,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        return_token_ids: bool = True,
        **extra: Any,
    ) -> ChatCompletionResponse:
        """`POST /v1/chat/completions` (the model's chat template is applied server-side)."""
        body = _drop_none(
            dict(
                model=model,
                messages=messages,
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop=stop,
                seed=seed,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                return_token_ids=return_token_ids,
                **extra,
            )
        )
        response = await self._request("POST", "/v1/chat/completions", json_body=body)
        return ChatCompletionResponse.model_validate(response.json())

    # --- adapters --------------------------------------------------------------------------------

    async def load_adapter(
        self, lora_name: str, lora_path: str, *, fence: dict[str, Any] | None = None
    ) -> None:
        """Serve the PEFT adapter at `lora_path` (a path the generator can read) as `lora_name`.

        `fence` (`{"key": job id, "token": run's fencing token}`) makes Crucible's generator refuse
        the load (400, `param: fence`) when it has seen a newer token for that key; vLLM ignores it.
        Raises `GeneratorAPIError` (e.g. 400 already loaded, 404 no adapter at the path). A retry
        that finds the name loaded means an earlier attempt landed, and counts as success.
        """
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path}
        if fence is not None:
            body["fence"] = fence
        for attempt in range(1 + self.retries):
            try:
                await self._request("POST", "/v1/load_lora_adapter", json_body=body, retries=0)
                return
            except GeneratorAPIError as exc:
                if exc.already_loaded and attempt > 0:
                    return
                if not exc.retryable or attempt == self.retries:
                    raise
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            await asyncio.sleep(self.backoff * 2**attempt)

    async def unload_adapter(self, lora_name: str, *, missing_ok: bool = False) -> None:
        """Stop serving `lora_name`. 404 raises unless `missing_ok` or an earlier attempt landed."""
        body = {"lora_name": lora_name}
        for attempt in range(1 + self.retries):
            try:
                await self._request("POST", "/v1/unload_lora_adapter", json_body=body, retries=0)
                return
            except GeneratorAPIError as exc:
                if exc.status == 404 and (missing_ok or attempt > 0):
                    return
                if not exc.retryable or attempt == self.retries:
                    raise
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            await asyncio.sleep(self.backoff * 2**attempt)


class GeneratorPool:
    """Several generator replicas: adapter loads go to all of them, requests round-robin; a request
    of several prompts is split over them (`complete`)."""

    def __init__(self, clients: Sequence[GeneratorClient]) -> None:
        if not clients:
            raise ValueError("a generator pool needs at least one replica")
        self.clients = list(clients)
        self._next = itertools.cycle(self.clients)

    @classmethod
    def from_urls(cls, urls: Sequence[str], **client_kwargs: Any) -> GeneratorPool:
        return cls([GeneratorClient(url, **client_kwargs) for url in urls])

    async def __aenter__(self) -> GeneratorPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))

    def pick(self) -> GeneratorClient:
        """The next replica, round-robin."""
        return next(self._next)

    async def wait_ready(self, timeout: float = 300.0) -> None:
        await asyncio.gather(*(c.wait_ready(timeout) for c in self.clients))

    async def load_adapter(
        self, lora_name: str, lora_path: str, *, fence: dict[str, Any] | None = None
    ) -> None:
        """Load on every replica, all-or-nothing: on any failure, unload where it succeeded, then raise."""
        results = await asyncio.gather(
            *(c.load_adapter(lora_name, lora_path, fence=fence) for c in self.clients), return_exceptions=True
        )
        failures = {
            c.base_url: r for c, r in zip(self.clients, results, strict=True) if isinstance(r, BaseException)
        }
        if not failures:
            return
        loaded = [c for c, r in zip(self.clients, results, strict=True) if not isinstance(r, BaseException)]
        undo = await asyncio.gather(
            *(c.unload_adapter(lora_name, missing_ok=True) for c in loaded), return_exceptions=True
        )
        rollback_failures = {
            c.base_url: r for c, r in zip(loaded, undo, strict=True) if isinstance(r, BaseException)
        }
        rolled_back = [c.base_url for c in loaded if c.base_url not in rollback_failures]
        raise AdapterBroadcastError(lora_name, failures, rolled_back, rollback_failures)

    async def unload_adapter(self, lora_name: str, *, missing_ok: bool = True) -> None:
        """Unload from every replica; raises the first failure after trying them all."""
        results = await asyncio.gather(
            *(c.unload_adapter(lora_name, missing_ok=missing_ok) for c in self.clients),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def complete(self, prompt: Any, **kwargs: Any) -> CompletionResponse:
        """One completion request; several prompts are split into contiguous shares, one per
        replica, sent at once and answered as one response (choices numbered as if one replica
        had answered: `prompt_index * n + j`). A seeded request draws the same samples either way:
        sample `j` of every prompt is seeded `seed + j`, whichever replica decodes it."""
        shares = split_prompts(prompt, len(self.clients))
        if len(shares) < 2:
            return await self.pick().complete(prompt, **kwargs)
        answers = await asyncio.gather(*(self.pick().complete(share, **kwargs) for share in shares))
        return merge_completions(answers, [len(share) for share in shares], kwargs.get("n", 1))

    async def complete_stream(self, prompt: Any, **kwargs: Any) -> AsyncIterator[CompletionResponseChoice]:
        """`complete` streamed: the replicas' shares at once, each choice (numbered as `complete`
        numbers it) yielded as soon as its replica finished it."""
        shares = split_prompts(prompt, len(self.clients))
        if len(shares) < 2:
            async for choice in self.pick().complete_stream(prompt, **kwargs):
                yield choice
            return
        n = kwargs.get("n", 1)
        found: asyncio.Queue[CompletionResponseChoice | Exception | None] = asyncio.Queue()
        firsts = list(itertools.accumulate((len(share) for share in shares), initial=0))

        async def pump(client: GeneratorClient, share: list[Any], first: int) -> None:
            try:
                async for choice in client.complete_stream(share, **kwargs):
                    found.put_nowait(choice.model_copy(update={"index": choice.index + first * n}))
            except Exception as exc:
                found.put_nowait(exc)
            found.put_nowait(None)

        pumps = [asyncio.ensure_future(pump(self.pick(), s, f)) for s, f in zip(shares, firsts, strict=False)]
        try:
            running = len(pumps)
            while running:
                item = await found.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    running -= 1
                else:
                    yield item
        finally:
            for task in pumps:
                task.cancel()

    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> ChatCompletionResponse:
        return await self.pick().chat(messages, **kwargs)


def split_prompts(prompt: Any, replicas: int) -> list[list[Any]]:
    """Contiguous, near-equal shares of a list of prompts (texts or token-id lists), at most one
    per replica; [] for a single prompt (a text, or one token-id list), which is not split.

    >>> split_prompts(["a", "b", "c", "d", "e"], 2)
    [['a', 'b', 'c'], ['d', 'e']]
    >>> split_prompts([[1, 2], [3]], 4)
    [[[1, 2]], [[3]]]
    >>> split_prompts([5, 6, 7], 2), split_prompts("a", 2)
    ([], [])
    """
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return []
    parts = min(replicas, len(prompt))
    size, extra = divmod(len(prompt), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [prompt[a:b] for a, b in itertools.pairwise(bounds)]


def merge_completions(
    answers: Sequence[CompletionResponse], prompts: Sequence[int], n: int
) -> CompletionResponse:
    """The answers to consecutive shares of one request's prompts as the answer to the whole:
    choices renumbered by their share's first prompt, usage summed."""
    choices, first = [], 0
    for answer, count in zip(answers, prompts, strict=True):
        choices += [c.model_copy(update={"index": c.index + first * n}) for c in answer.choices]
        first += count
    usage = UsageInfo(
        prompt_tokens=sum(a.usage.prompt_tokens for a in answers),
        total_tokens=sum(a.usage.total_tokens for a in answers),
        completion_tokens=sum(a.usage.completion_tokens or 0 for a in answers),
    )
    return answers[0].model_copy(update={"choices": choices, "usage": usage})
