"""`bench/common.services`: the sandbox and the generators start at once, the trainer warms beside
them (on hosts with the cores for it; for a job of several ranks, its standby ranks start) and is
done before the job runs, and whatever came up is stopped at the end, also when one of them fails
to start. The services are stand-ins here (the tiny race in test_bench_tta.py starts real ones);
what is tested is how `services` composes them."""

from __future__ import annotations

import threading
import time

import pytest
from crucible_shared.jobs import TrainJob
from crucible_trainer.runtime import warm

from bench import common


class Stand:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.url = name, log, f"http://127.0.0.1:1/{name}"

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")


@pytest.fixture
def stands(monkeypatch):
    log: list[str] = []
    started = threading.Barrier(3, timeout=10)  # the sandbox and two generators, all at once

    def sandbox(work, **env):
        started.wait()
        if "sandbox fails" in log:
            raise RuntimeError("the sandbox did not start")
        return Stand("sandbox", log)

    def generator(work, model, rows, *, env=None, **kw):
        started.wait()
        return Stand(f"generator-{env['CUDA_VISIBLE_DEVICES']}", log)

    def warm_up(spec=None, parts=None):
        time.sleep(0.3)
        log.append(f"warmed {spec.seed}")
        parts.update(imports_s=0.2, resolve_s=0.1)
        return 0.3

    monkeypatch.setattr(common, "sandbox", sandbox)
    monkeypatch.setattr(common, "spawn_generator", generator)
    monkeypatch.setattr(warm, "MIN_CORES", 1)
    monkeypatch.setattr(warm, "warm_up", warm_up)
    return log


def warming() -> bool:
    return any(t.name == "crucible-warm-up" and t.is_alive() for t in threading.enumerate())


def test_the_services_start_at_once_and_the_trainer_is_warm_before_the_job(stands, tmp_path) -> None:
    spec, ready = TrainJob.model_validate({"seed": 7}), {}
    with common.services(tmp_path, "m", devices=["1", "0"], job=spec, ready=ready) as settings:
        assert not warming() and stands == ["warmed 7"]
        # When each was up, from the call: the services at once, the warm-up's end and its imports'
        assert set(ready) == {"sandbox", "generator-0", "generator-1", "trainer warm-up", "trainer imports"}
        assert ready["trainer warm-up"] == 0.3 and ready["trainer imports"] == 0.2
        assert all(0 <= ready[k] < 5 for k in ("sandbox", "generator-0", "generator-1"))
        assert settings.generator_urls == ["http://127.0.0.1:1/generator-1", "http://127.0.0.1:1/generator-0"]
        assert settings.sandbox_url == "http://127.0.0.1:1/sandbox"
    assert sorted(stands[1:]) == ["stop generator-0", "stop generator-1", "stop sandbox"]


def test_a_service_that_fails_to_start_stops_the_others_and_the_warm_up(stands, tmp_path) -> None:
    stands.append("sandbox fails")
    with (
        pytest.raises(RuntimeError, match="the sandbox did not start"),
        common.services(tmp_path, "m", devices=["0", "1"], job=TrainJob()),
    ):
        pytest.fail("no job runs without its services")
    assert not warming()
    assert sorted(stands[1:]) == ["stop generator-0", "stop generator-1", "warmed 0"]


def test_no_warm_up_without_a_job_or_on_a_small_host(stands, tmp_path, monkeypatch) -> None:
    with common.services(tmp_path, "m", devices=["0", "1"]):
        pass
    monkeypatch.setattr(warm, "MIN_CORES", 10**6)
    with common.services(tmp_path, "m", devices=["0", "1"], job=TrainJob()):
        pass
    assert not any(line.startswith("warmed") for line in stands)


def test_a_job_of_several_ranks_has_its_ranks_started_beside_the_services(
    stands, tmp_path, monkeypatch
) -> None:
    from crucible_trainer.distributed import launch

    monkeypatch.setattr(launch, "keep_standby", lambda ranks: stands.append(f"standby {ranks}") or object())
    monkeypatch.setattr(launch, "release_standby", lambda: stands.append("release standby"))
    spec = TrainJob.model_validate({"distributed": {"train_gpus": 2}})
    with common.services(tmp_path, "m", devices=["0", "1"], job=spec):
        assert stands == ["standby 2"]  # not this process's warm-up: it would not help the ranks
    assert stands[1] == "release standby" and len(stands) == 5
