"""The variables compose and the Kubernetes manifests set match what each service reads.

What a service reads comes from its code (tests/deploy/env.py): its pydantic-settings model, the
`os.environ` look-ups of its package and `crucible_shared`, the `${GENERATOR_*}` of the vLLM launch
script, and a short, reasoned list of third-party variables. Every variable set (by the image's
ENV, compose or k8s) must be read by the service, and every variable a container needs must be set.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from tests.deploy import docker, kubectl
from tests.deploy.env import IMAGES, READERS, ROOT_VARIABLES
from tests.deploy.stack import ROOT, compose_stack, workloads

VARIANTS = ["gpu", "cpu"]


def image_env(image: str) -> dict[str, str]:
    dockerfile, _ = IMAGES[image]
    return docker.env(docker.final_stage(docker.parse((ROOT / dockerfile).read_text())))


def check(where: str, image: str, env: dict[str, str | None]) -> None:
    reader = READERS[IMAGES[image][1]]
    reads = reader.reads()
    baked = image_env(image)
    unread = sorted(set(env) - reads)
    assert not unread, f"{where} sets variables {reader.name} never reads: {unread}"
    unread = sorted(set(baked) - reads)
    assert not unread, f"{image}'s Dockerfile sets variables {reader.name} never reads: {unread}"
    effective = {**baked, **env}
    for names in reader.required():
        assert any(effective.get(n) is None or effective.get(n) for n in names & set(effective)), (
            f"{where}: set one of {sorted(names)}"
        )


def compose_containers(variant: str):
    for name, svc in compose_stack(variant)["services"].items():
        yield name, svc, svc["image"].partition(":")[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_sets_what_services_read(variant: str) -> None:
    checked = set()
    for name, svc, image in compose_containers(variant):
        if image not in IMAGES:
            assert "environment" not in svc, f"{name}: a third-party image gets no Crucible variables"
            continue
        check(f"compose ({variant}) {name}", image, svc.get("environment", {}))
        checked.add(IMAGES[image][1])
    assert checked == {"gateway", "sandbox", "trainer", "generator" if variant == "cpu" else "generator-vllm"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_k8s_sets_what_services_read(variant: str) -> None:
    checked = set()
    for obj, spec in workloads(variant):
        for container in spec["containers"]:
            image = kubectl.split_image(container["image"])[0]
            if image not in IMAGES:
                assert "env" not in container, container["name"]
                continue
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            check(f"k8s ({variant}) {obj['metadata']['name']}", image, env)
            checked.add(IMAGES[image][1])
    assert checked == {"gateway", "sandbox", "trainer", "generator" if variant == "cpu" else "generator-vllm"}


def test_a_misspelt_variable_is_caught() -> None:
    with pytest.raises(AssertionError, match="never reads"):
        check("example", "crucible/sandbox", {"CRUCIBLE_SANDBOX_WORKER": "4"})
    with pytest.raises(AssertionError, match="set one of"):
        check("example", "crucible/trainer", {"REDIS_URL": "redis://redis:6379/0"})


def _compose_mounts(svc: dict) -> dict[str, str]:
    """volume name (or host path) -> mount path."""
    return {v["source"]: v["target"] for v in svc.get("volumes", [])}


def _k8s_env_and_mounts(variant: str, name: str) -> tuple[dict[str, str], dict[str, str]]:
    for obj, spec in workloads(variant):
        if obj["metadata"]["name"] != name:
            continue
        container = spec["containers"][0]
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        }
        mounts = {claims[m["name"]]: m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims}
        image = kubectl.split_image(container["image"])[0]
        env = {**image_env(image), **{e["name"]: e.get("value") for e in container.get("env", [])}}
        return env, mounts
    raise KeyError(name)


def _under(path: str, root: str) -> bool:
    return PurePosixPath(path).is_relative_to(root)


@pytest.mark.parametrize("variant", VARIANTS)
def test_directories_point_into_the_mounted_volumes(variant: str) -> None:
    """Adapters are loaded by path: trainer, generators and gateway must agree on it."""
    services = compose_stack(variant)["services"]
    deployments = {
        "compose": {
            name: (
                {
                    **image_env(services[name]["image"].partition(":")[0]),
                    **services[name].get("environment", {}),
                },
                _compose_mounts(services[name]),
            )
            for name in ("gateway", "generator", "trainer")
        },
        "k8s": {
            name: tuple(_k8s_env_and_mounts(variant, name)) for name in ("gateway", "generator", "trainer")
        },
    }
    volume = {
        "compose": {"adapters": "adapters", "runs": "runs", "models": "models"},
        "k8s": {"adapters": "crucible-adapters", "runs": "crucible-runs", "models": "crucible-models"},
    }
    for where, containers in deployments.items():
        v = volume[where]
        trainer_env, trainer_mounts = containers["trainer"]
        gateway_env, gateway_mounts = containers["gateway"]
        _, generator_mounts = containers["generator"]
        adapters = trainer_env["CRUCIBLE_TRAINER_ADAPTER_DIR"]
        assert trainer_mounts[v["adapters"]] == adapters, where
        assert generator_mounts[v["adapters"]] == adapters, f"{where}: generator sees adapters elsewhere"
        assert gateway_env["CRUCIBLE_GATEWAY_ADAPTER_DIR"] == gateway_mounts[v["adapters"]] == adapters, where
        runs = trainer_env["CRUCIBLE_TRAINER_RUNS_DIR"]
        assert trainer_mounts[v["runs"]] == runs == gateway_env["CRUCIBLE_GATEWAY_RUNS_DIR"], where
        assert gateway_mounts[v["runs"]] == runs, where
        for name in ("trainer", "generator"):
            env, mounts = containers[name]
            for var in ("HF_HOME", "CRUCIBLE_CACHE_DIR"):
                if var in env:
                    assert _under(env[var], mounts[v["models"]]), (
                        f"{where} {name}: {var} is not on the model volume"
                    )
            assert "HF_HOME" in env, f"{where} {name}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_and_trainer_agree_on_where_jobs_may_read(variant: str) -> None:
    """The gateway refuses a job naming a path outside the roots and the trainer checks again: both
    hold the same roots, and each lies on a volume the trainer mounts or in data its image carries."""
    services = compose_stack(variant)["services"]
    compose_env = {
        name: {
            **image_env(services[name]["image"].partition(":")[0]),
            **services[name].get("environment", {}),
        }
        for name in ("gateway", "trainer")
    }
    deployments = {
        "compose": (compose_env["gateway"], compose_env["trainer"], _compose_mounts(services["trainer"])),
        "k8s": (
            *(_k8s_env_and_mounts(variant, n)[0] for n in ("gateway", "trainer")),
            _k8s_env_and_mounts(variant, "trainer")[1],
        ),
    }
    for where, (gateway, trainer, trainer_mounts) in deployments.items():
        baked = [trainer["CRUCIBLE_DATA_DIR"]]
        for var in ROOT_VARIABLES:
            assert gateway[var] == trainer[var], f"{where}: {var} differs"
            for root in trainer[var].split(","):
                assert any(_under(root, m) for m in [*trainer_mounts.values(), *baked]), (
                    f"{where}: {var} root {root} is neither mounted nor in the trainer image"
                )
        assert "/data/datasets" in trainer["CRUCIBLE_DATA_ROOTS"].split(",")
