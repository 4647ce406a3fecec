"""Specs the gateway once accepted (202) that then failed in the worker: each is now a 4xx at
submission, the one error envelope naming the field (issue 23, section 4). The worker still checks
each again before it reads anything (tests/unit/test_path_attacks.py).

A gateway of its own, with data, model and adapter roots under a temporary folder it sees.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from crucible_shared import keys
from crucible_shared.gateway_client import GatewayClient
from redis import Redis

from tests.servers import Service, spawn


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("submission")
    dirs = {name: base / name for name in ("data", "models", "adapters", "runs", "store", "outside")}
    for folder in dirs.values():
        folder.mkdir()
    (dirs["data"] / "tasks.jsonl").write_text('{"task_id": "t", "prompt": "p", "tests": ["assert True"]}\n')
    (dirs["outside"] / "secret.jsonl").write_text("s3cret\n")
    (dirs["data"] / "tasks-link.jsonl").symlink_to(dirs["outside"] / "secret.jsonl")
    (dirs["data"] / "elsewhere").symlink_to(dirs["outside"], target_is_directory=True)
    (dirs["adapters"] / "sft" / "v3").mkdir(parents=True)
    (dirs["adapters"] / "sft" / "v3" / "adapter_config.json").write_text("{}")
    return dirs


@pytest.fixture(scope="module")
def gw(redis_url, roots) -> Iterator[Service]:
    env = {
        "REDIS_URL": redis_url,
        "CRUCIBLE_GATEWAY_RUNS_DIR": str(roots["runs"]),
        "CRUCIBLE_GATEWAY_ADAPTER_DIR": str(roots["store"]),
        "CRUCIBLE_DATA_ROOTS": str(roots["data"]),
        "CRUCIBLE_MODEL_ROOTS": str(roots["models"]),
        "CRUCIBLE_ADAPTER_ROOTS": str(roots["adapters"]),
    }
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT") as service:
        yield service


def refused(gw: Service, spec: dict, field: str, status: int = 422) -> str:
    r = httpx.post(f"{gw.url}/v1/jobs", json=spec, timeout=30)
    assert r.status_code == status, (spec, r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and body["error"]["field"] == field, body
    return body["error"]["message"]


def accepted(gw: Service, spec: dict) -> str:
    r = httpx.post(f"{gw.url}/v1/jobs", json=spec, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    GatewayClient(gw.url).cancel(job_id)  # nothing should run it
    return job_id


# -- pipeline `reuse` of a job that doesn't exist -------------------------------------------------


def test_reuse_names_an_existing_pipeline_run(gw, roots) -> None:
    message = refused(gw, {"kind": "pipeline", "reuse": "pipeline-nope"}, "pipeline.reuse")
    assert "'pipeline-nope' names no job" in message
    other = accepted(gw, {"kind": "eval", "data": {"dataset": "mbpp", "ids": [11]}})
    assert "is a job of kind eval" in refused(gw, {"kind": "pipeline", "reuse": other}, "pipeline.reuse")
    earlier = accepted(gw, {"kind": "pipeline", "name": "earlier"})
    assert "no stage records" in refused(gw, {"kind": "pipeline", "reuse": earlier}, "pipeline.reuse")
    (roots["runs"] / earlier).mkdir()
    (roots["runs"] / earlier / "pipeline.json").write_text("{}")
    accepted(gw, {"kind": "pipeline", "reuse": earlier})


@pytest.mark.parametrize("reuse", ["../../etc", "..", "/etc", "x/../../y", "%2e%2e%2fetc", "x\x00y", "~root"])
def test_reuse_that_is_not_a_job_id_is_refused(gw, reuse: str) -> None:
    """One path component, a job id: separators, dots, NUL (already so: the field's pattern)."""
    refused(gw, {"kind": "pipeline", "reuse": reuse}, "pipeline.reuse")


def test_reuse_of_a_run_dir_whose_records_are_a_link_is_refused(gw, roots) -> None:
    earlier = accepted(gw, {"kind": "pipeline", "name": "linked"})
    (roots["runs"] / earlier).mkdir()
    (roots["runs"] / earlier / "pipeline.json").symlink_to(roots["outside"] / "secret.jsonl")
    refused(gw, {"kind": "pipeline", "reuse": earlier}, "pipeline.reuse")


# -- an adapter that doesn't exist inside the roots -----------------------------------------------


def test_an_adapter_that_does_not_exist_is_refused(gw, roots) -> None:
    message = refused(gw, {"kind": "eval", "adapter": "sft/v4"}, "eval.adapter")
    assert "no PEFT adapter at sft/v4" in message
    refused(gw, {"kind": "train", "model": {"init_adapter": "sft/v9"}}, "train.model.init_adapter")
    missing_file = {"kind": "pipeline", "model": {"init_adapter": str(roots["adapters"] / "gone")}}
    refused(gw, missing_file, "pipeline.model.init_adapter")
    accepted(gw, {"kind": "eval", "adapter": "sft/v3"})


# -- steps: 1000000 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"kind": "train", "optim": {"steps": 1_000_000}}, "train.optim.steps"),
        (
            {
                "kind": "train",
                "method": {"name": "sft", "path": "tasks.jsonl", "max_steps": 1_000_000},
                "optim": {"lr": 1e-4},
            },
            "train.method.max_steps",
        ),
        ({"kind": "pipeline", "train": {"name": "sft", "max_steps": 10_001}}, "pipeline.train.max_steps"),
    ],
)
def test_a_training_length_over_the_cap_is_refused_and_says_so(gw, spec: dict, field: str) -> None:
    message = refused(gw, spec, field)
    assert "cap of 10000" in message and "CRUCIBLE_GATEWAY_MAX_STEPS" in message


def test_a_training_length_at_the_cap_is_accepted(gw) -> None:
    accepted(gw, {"kind": "train", "optim": {"steps": 10_000}})


# -- a data file that is a symbolic link out of the roots -----------------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "link"),
    [
        (
            {"kind": "train", "data": {"dataset": "jsonl", "path": "tasks-link.jsonl"}},
            "train.data.path",
            "tasks-link.jsonl",
        ),
        (
            {"kind": "eval", "data": {"dataset": "jsonl", "path": "elsewhere/secret.jsonl"}},
            "eval.data.path",
            "elsewhere",
        ),
        (
            {"kind": "train", "eval": {"data": {"dataset": "stdio", "path": "tasks-link.jsonl"}}},
            "train.eval.data.path",
            "tasks-link.jsonl",
        ),
        (
            {
                "kind": "train",
                "method": {"name": "dpo", "path": "elsewhere/secret.jsonl"},
                "optim": {"lr": 1e-4},
            },
            "train.method.path",
            "elsewhere",
        ),
    ],
)
def test_a_data_file_linked_out_of_the_roots_is_refused_by_name(gw, roots, spec, field, link) -> None:
    message = refused(gw, spec, field)
    assert f"{roots['data'] / link} is a symbolic link" in message, message
    assert "s3cret" not in message


def test_a_data_file_that_does_not_exist_is_refused(gw, roots) -> None:
    message = refused(
        gw, {"kind": "eval", "data": {"dataset": "jsonl", "path": "nope.jsonl"}}, "eval.data.path"
    )
    assert "nope.jsonl does not exist" in message
    accepted(gw, {"kind": "eval", "data": {"dataset": "jsonl", "path": "tasks.jsonl"}})


# -- names: printable only -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a\x00b",
        "red \x1b[31mALERT\x1b[0m",
        "evil\u202etxt.exe",
        "two\nlines",
        "tab\there",
        "bidi\u2066x\u2069",
    ],
    ids=["NUL", "ESC", "RTL-override", "newline", "tab", "isolate"],
)
def test_names_with_control_or_format_characters_are_refused(gw, name: str) -> None:
    for spec, field in (
        ({"kind": "train", "name": name}, "train.name"),
        ({"kind": "eval", "name": name}, "eval.name"),
        ({"kind": "pipeline", "name": name}, "pipeline.name"),
        ({"kind": "train", "logging": {"run_name": name}}, "train.logging.run_name"),
    ):
        message = refused(gw, spec, field)
        assert "printable" in message, message


def test_printable_names_in_any_script_are_accepted(gw) -> None:
    job_id = accepted(gw, {"kind": "eval", "name": "évaluation — 評価 ✓ (run 2)"})
    r = httpx.get(f"{gw.url}/v1/jobs/{job_id}")
    assert r.json()["name"] == "évaluation — 評価 ✓ (run 2)"


# -- accepted once, failing later: refused at submission, naming the field (issue 35) ----------


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({"kind": "eval", "data": {"ids": [11, 5000]}}, "eval.data.ids.1", "split (ids 1-974)"),
        ({"kind": "eval", "data": {"split": "train", "ids": [11]}}, "eval.data.ids.0", "train split"),
        ({"kind": "eval", "data": {"id_range": [900, 1200]}}, "eval.data.id_range", "outside"),
        ({"kind": "eval", "adapter": ""}, "eval.adapter", "at least 1 character"),
        ({"kind": "train", "optim": {"steps": True}}, "train.optim.steps", "not true"),
        ({"kind": "train", "optim": {"steps": "2"}}, "train.optim.steps", 'not "2"'),
        ({"kind": "train", "optim": {"micro_batch": 0}}, "train.optim.micro_batch", "between 1 and 4096"),
        ({"kind": "eval", "n": True}, "eval.n", "not true"),
    ],
)
def test_values_accepted_before_and_failing_later_are_refused_naming_the_field(
    gw, spec, field, words
) -> None:
    assert words in refused(gw, spec, field)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (  # 10,000 steps x 4,096 problems x a group of 64
            {
                "kind": "train",
                "method": {"name": "grpo", "group_size": 64},
                "optim": {"steps": 10_000, "problems_per_step": 4096},
            },
            "train.optim.steps",
        ),
        (  # n = 1,000 over all of MBPP at 8,192 tokens
            {"kind": "eval", "n": 1000, "data": {"split": "all"}, "max_tokens": 8192, "ks": [1]},
            "eval.n",
        ),
        (  # SFT: 1,000 epochs of a file of 1,000 rows at 4,096 tokens
            {
                "kind": "train",
                "method": {"name": "sft", "path": "sft-rows.jsonl", "epochs": 1000, "max_length": 4096},
                "optim": {"lr": 1e-4},
            },
            "train.method.epochs",
        ),
        (  # a pipeline sampling 1,024 candidates of 8,192 tokens for every MBPP problem
            {"kind": "pipeline", "data": {"split": "all"}, "generate": {"k": 1024, "max_tokens": 8192}},
            "pipeline.generate.k",
        ),
        (  # a pipeline training 1,000 epochs on the 4 best of 8 candidates of 374 problems
            {"kind": "pipeline", "train": {"name": "sft", "epochs": 1000, "max_length": 4096}},
            "pipeline.train.epochs",
        ),
        (  # DPO: 20 pairs of each problem's candidates, 200,000 steps of 32 pairs at 4,096 tokens
            {
                "kind": "pipeline",
                "stages": ["generate", "annotate", "build", "train"],
                "build": {"max_pairs": 20},
                "train": {"name": "dpo", "max_steps": 10_000, "max_length": 4096},
                "optim": {"lr": 1e-5, "micro_batch": 32},
            },
            "pipeline.train.max_steps",
        ),
        (  # a pipeline's baseline and final evaluations: n = 1,000 over all of MBPP
            {
                "kind": "pipeline",
                "eval": {"n": 1000, "data": {"split": "all"}, "max_tokens": 8192, "ks": [1]},
            },
            "pipeline.eval.n",
        ),
    ],
)
def test_a_job_over_the_work_cap_is_refused(gw, roots, spec: dict, field: str) -> None:
    (roots["data"] / "sft-rows.jsonl").write_text('{"prompt": "p", "completion": "c"}\n' * 1000)
    message = refused(gw, spec, field)
    assert "CRUCIBLE_GATEWAY_MAX_WORK_TOKENS" in message and "tokens" in message


def test_a_job_within_the_work_cap_is_accepted(gw) -> None:
    accepted(gw, {"kind": "eval", "n": 10, "data": {"split": "test"}, "max_tokens": 512, "ks": [1]})
    accepted(gw, {"kind": "train", "optim": {"steps": 1000, "problems_per_step": 16}})
    accepted(gw, {"kind": "pipeline"})
    accepted(gw, {"kind": "pipeline", "rounds": 4, "train": {"name": "dpo"}, "optim": {"lr": 1e-5}})


@pytest.fixture
def stub_generator() -> Iterator[str]:
    """A generator stand-in that answers `/v1/models` with one base model, `tiny-model`."""
    listing = {"object": "list", "data": [{"id": "tiny-model", "root": "/srv/models/tiny-model"}]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(listing).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_eval_of_a_model_the_generators_do_not_serve_is_refused(
    gw, redis_url, stub_generator, tmp_path
) -> None:
    """A live trainer worker reports what its generators serve; an eval job naming another base
    model is refused naming `eval.model.base`, one naming the served model (by id or by the last
    part of its root) is accepted, and with no worker up the worker that takes the job checks."""
    redis = Redis.from_url(redis_url)
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "CRUCIBLE_TRAINER_GENERATOR_URLS": stub_generator,
        "CRUCIBLE_CACHE_DIR": str(tmp_path / "cache"),
    }
    cmd = [sys.executable, "-m", "crucible_trainer.worker", "--queues", "nothing", "--name", "served"]
    worker = subprocess.Popen(cmd, env=env)
    eval_of = {"kind": "eval", "data": {"ids": [11]}, "max_tokens": 64}
    try:
        deadline = time.monotonic() + 120
        while not redis.hget(keys.worker_served(), "served"):
            assert time.monotonic() < deadline, "the worker never reported what its generators serve"
            time.sleep(0.2)
        message = refused(gw, {**eval_of, "model": {"base": "acme/other-coder"}}, "eval.model.base")
        assert "generators serve tiny-model (/srv/models/tiny-model)" in message
        accepted(gw, {**eval_of, "model": {"base": "tiny-model"}})
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert not redis.hexists(keys.worker_served(), "served")
    accepted(gw, {**eval_of, "model": {"base": "acme/other-coder"}})


@pytest.mark.parametrize(
    "body",
    [
        b'{"kind": "eval", "name": "\xff\xfe"}',  # not UTF-8
        b'{"kind": "eval", "max_tokens": ' + b"9" * 5000 + b"}",  # a 5,000-digit integer
        b"[" * 200_000 + b"]" * 200_000,  # 200k deep
        b'{"kind": "eval",',  # cut short
    ],
    ids=["utf8", "huge-int", "deep", "truncated"],
)
def test_bodies_that_are_not_json_get_the_envelope_naming_the_body(gw, body: bytes) -> None:
    r = httpx.post(
        f"{gw.url}/v1/jobs", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "body" and error["message"].startswith("malformed JSON"), error
