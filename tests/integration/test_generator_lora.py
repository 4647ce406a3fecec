"""LoRA hot-swap on the real server: adapters change outputs, share batches, load and unload safely."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.integration.generator_fixtures import BASE, MAX_LORAS

PROMPT = "def is_prime(n):"


def load(url: str, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def greedy(client: openai.OpenAI, model: str, max_tokens: int = 12, prompt: str = PROMPT) -> str:
    return (
        client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        .choices[0]
        .text
    )


@pytest.fixture
def loaded(generator, lora_dirs):
    """Adapters v1 and v2 loaded as `swap-v1` / `swap-v2` for one test, unloaded afterwards."""
    names = {"swap-v1": lora_dirs["v1"], "swap-v2": lora_dirs["v2"]}
    for name, path in names.items():
        assert load(generator.url, name, path).status_code == 200
    yield list(names)
    for name in names:
        unload(generator.url, name)


def test_adapters_change_outputs_and_leave_the_base_alone(generator, client, lora_dirs):
    base_before = greedy(client, BASE)
    response = load(generator.url, "swap-v1", lora_dirs["v1"])
    assert (
        response.status_code == 200 and response.text == "Success: LoRA adapter 'swap-v1' added successfully."
    )
    assert load(generator.url, "swap-v2", lora_dirs["v2"]).status_code == 200
    try:
        cards = {m.id: m for m in client.models.list().data}
        assert cards["swap-v1"].model_extra["parent"] == BASE
        assert cards["swap-v1"].model_extra["root"] == lora_dirs["v1"]
        v1, v2 = greedy(client, "swap-v1"), greedy(client, "swap-v2")
        assert len({base_before, v1, v2}) == 3
        assert greedy(client, BASE) == base_before
    finally:
        unload(generator.url, "swap-v1")
        unload(generator.url, "swap-v2")


def test_concurrent_requests_each_get_their_own_adapter(client, loaded):
    models = [BASE, *loaded]
    solo = {m: greedy(client, m) for m in models}
    with ThreadPoolExecutor(9) as pool:
        mixed = list(pool.map(lambda m: (m, greedy(client, m)), models * 3))
    for model, text in mixed:
        assert text == solo[model], model


def test_unload_gives_404_and_frees_the_name(generator, client, lora_dirs):
    assert load(generator.url, "job.7-v1", lora_dirs["v1"]).status_code == 200
    greedy(client, "job.7-v1", max_tokens=2)
    response = unload(generator.url, "job.7-v1")
    assert response.status_code == 200 and "removed successfully" in response.text
    with pytest.raises(openai.NotFoundError):
        greedy(client, "job.7-v1", max_tokens=2)
    again = unload(generator.url, "job.7-v1")
    assert again.status_code == 404 and again.json()["error"]["type"] == "NotFoundError"
    assert "job.7-v1" not in {m.id for m in client.models.list().data}


def test_load_errors_are_vllm_shaped(generator, lora_dirs, loaded, tmp_path):
    twice = load(generator.url, "swap-v1", lora_dirs["v1"])
    assert twice.status_code == 400 and twice.json()["error"]["type"] == "InvalidUserInput"
    missing = load(generator.url, "missing-v1", str(tmp_path / "nothing-here"))
    assert missing.status_code == 404
    assert missing.json()["error"]["message"].startswith(
        "Loading lora missing-v1 failed: No adapter found for"
    )
    too_big = load(generator.url, "big-v1", lora_dirs["rank128"])
    assert too_big.status_code == 400 and "max_lora_rank" in too_big.json()["error"]["message"]
    no_name = httpx.post(f"{generator.url}/v1/load_lora_adapter", json={"lora_path": lora_dirs["v1"]})
    assert no_name.status_code == 400 and no_name.json()["error"]["param"] == "lora_name"


def test_at_max_loras_a_load_evicts_the_least_recently_used_idle_adapter(
    generator, client, lora_dirs, loaded
):
    """A job that died never unloads its versions; they must not lock every later job out."""
    extra = [f"fill-v{i}" for i in range(MAX_LORAS - len(loaded))]
    try:
        for name in extra:
            assert load(generator.url, name, lora_dirs["v1"]).status_code == 200
        for name in [*loaded, *extra[1:]]:  # all but fill-v0 served since it was loaded
            assert greedy(client, name, max_tokens=1) is not None
        assert load(generator.url, "over-v1", lora_dirs["v1"]).status_code == 200
        served = {m.id for m in client.models.list().data}
        assert "over-v1" in served and extra[0] not in served and set(loaded) | set(extra[1:]) <= served
        gone = httpx.post(
            f"{generator.url}/v1/completions", json={"model": extra[0], "prompt": "x", "max_tokens": 1}
        )
        assert gone.status_code == 404
        metrics = httpx.get(f"{generator.url}/metrics").text
        assert "crucible_generator_lora_evictions_total 1.0" in metrics
    finally:
        for name in [*extra, "over-v1"]:
            unload(generator.url, name)


@pytest.mark.slow
def test_loading_a_new_version_does_not_disturb_requests_in_flight(generator, client, lora_dirs, loaded):
    expected = greedy(client, "swap-v1", max_tokens=48)
    result = {}

    def in_flight():
        result["text"] = greedy(client, "swap-v1", max_tokens=48)

    thread = threading.Thread(target=in_flight)
    thread.start()
    try:
        # Load and unload other versions while v1 decodes.
        assert load(generator.url, "swap-v3", lora_dirs["v3"]).status_code == 200
        assert greedy(client, "swap-v3", max_tokens=2)
        assert unload(generator.url, "swap-v2").status_code == 200
        thread.join()
    finally:
        unload(generator.url, "swap-v3")
    assert result["text"] == expected


@pytest.mark.slow
def test_rss_stays_under_2gb_with_four_adapters(generator, client, lora_dirs):
    names = [f"mem-v{i}" for i in range(MAX_LORAS)]
    sources = ["v1", "v2", "v3", "v1"]
    try:
        for name, source in zip(names, sources, strict=True):
            assert load(generator.url, name, lora_dirs[source]).status_code == 200
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda m: greedy(client, m, max_tokens=8), names))
        with open(f"/proc/{generator.proc.pid}/status") as status:
            rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        assert rss_kb * 1024 < 2 * 1024**3, f"RSS {rss_kb / 1024:.0f} MiB"
    finally:
        for name in names:
            unload(generator.url, name)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_unloading_frees_adapter_memory(generator, client, lora_dirs):
    def rss_kb() -> int:
        with open(f"/proc/{generator.proc.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

    # An all-linear rank-16 adapter is ~ 20 MB of fp32 weights: loading then unloading it many times
    # must not grow the server by many multiples of that.
    before = rss_kb()
    for i in range(6):
        assert load(generator.url, f"churn-v{i}", lora_dirs["v3"]).status_code == 200
        assert unload(generator.url, f"churn-v{i}").status_code == 200
    assert rss_kb() - before < 60 * 1024


def test_fencing_a_load_from_an_older_run_of_a_job_is_refused(generator, lora_dirs):
    """`fence` (Crucible's extension of the load request): once a run of job `j` with token 2 has
    loaded, a load from its token-1 run is refused naming `fence`; other jobs are not affected."""

    def fenced(name: str, key: str, token: int) -> httpx.Response:
        body = {"lora_name": name, "lora_path": lora_dirs["v1"], "fence": {"key": key, "token": token}}
        return httpx.post(f"{generator.url}/v1/load_lora_adapter", json=body, timeout=60)

    key = f"fence-job-{os.getpid()}"
    try:
        assert fenced(f"{key}-v1", key, 1).status_code == 200
        assert fenced(f"{key}-v1-r2", key, 2).status_code == 200
        late = fenced(f"{key}-v2", key, 1)
        assert late.status_code == 400, late.text
        error = late.json()["error"]
        assert error["param"] == "fence" and "older than 2" in error["message"]
        assert unload(generator.url, f"{key}-v1").status_code == 200  # retiring stays allowed
        assert fenced(f"{key}-other-v1", f"{key}-other", 1).status_code == 200
    finally:
        for name in (f"{key}-v1", f"{key}-v1-r2", f"{key}-v2", f"{key}-other-v1"):
            unload(generator.url, name)
