"""compose.yaml (GPU host) and compose.cpu.yaml, as Docker Compose v2 itself resolves them: accepted,
valid against the Compose Specification, hardened, healthy-before-use and wired right."""

from __future__ import annotations

from pathlib import Path

import crucible_shared
import jsonschema
import pytest
from check_jsonschema.builtin_schemas import get_builtin_schema

from tests.deploy import compose, docker
from tests.deploy.env import IMAGES
from tests.deploy.stack import COMPOSE_FILES, ROOT, SECRETS, compose_stack

VARIANTS = ["gpu", "cpu"]
# Services that may write to their root filesystem, and why.
WRITABLE_ROOT = {"sandbox-lb": "compose writes its inline config into the container"}
# One-shot services (depended on with service_completed_successfully rather than a health check).
ONE_SHOT = {"volumes-init"}
# Third-party images and the variable that swaps each for a local build (deploy/base-images.sh).
THIRD_PARTY = {"redis": "REDIS_IMAGE", "sandbox-lb": "SANDBOX_LB_IMAGE", "volumes-init": "INIT_IMAGE"}
BUILD_PASSTHROUGH = {"PYTHON_IMAGE", "PIP_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_NO_INDEX"}


def services(variant: str) -> dict:
    return compose_stack(variant)["services"]


def mounts(svc: dict) -> dict[str, tuple[str, bool]]:
    """source (volume name or host path) -> (target, read-only)."""
    return {v["source"]: (v["target"], bool(v.get("read_only"))) for v in svc.get("volumes", [])}


def published(svc: dict) -> list[int]:
    return [p["target"] for p in svc.get("ports", [])]


def test_compose_is_version_2_24_or_newer() -> None:
    major, minor = (int(x) for x in compose.version().lstrip("v").split(".")[:2])
    assert (major, minor) >= (2, 24), "the files use !reset and !override"


@pytest.mark.parametrize("variant", VARIANTS)
def test_valid_against_the_compose_specification(variant: str) -> None:
    schema = get_builtin_schema("vendor.compose-spec")
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(compose_stack(variant))]
    assert not errors


def test_compose_refuses_what_the_schema_lets_through(tmp_path: Path) -> None:
    """The schema alone accepted compose.yaml while Compose refused it: pids_limit beside deploy pids."""
    path = tmp_path / "compose.yaml"
    path.write_text(
        "services:\n  s:\n    image: x\n    pids_limit: 512\n    deploy: {resources: {limits: {cpus: '1'}}}\n"
    )
    schema = get_builtin_schema("vendor.compose-spec")
    assert jsonschema.validators.validator_for(schema)(schema).is_valid(compose.load(path))
    with pytest.raises(compose.ComposeError, match="pids_limit"):
        compose.config([path], {})
    path.write_text("services:\n  s:\n    image: x\n    read_olny: true\n")
    with pytest.raises(compose.ComposeError, match="read_olny"):
        compose.config([path], {})


@pytest.mark.parametrize("secret", SECRETS)
def test_refuses_to_start_without_each_secret(secret: str) -> None:
    env = {k: v for k, v in SECRETS.items() if k != secret}
    with pytest.raises(compose.ComposeError, match=secret):
        compose.config(COMPOSE_FILES["gpu"], env)


def test_every_variable_has_a_default_or_is_a_required_secret_and_is_documented() -> None:
    docs = (ROOT / "docs/deploy.md").read_text()
    for path in COMPOSE_FILES["cpu"]:
        raw = compose.load(path)
        for name, op in compose.variables(raw).items():
            assert op in (":-", ":?"), f"{path.name}: ${{{name}}} needs a default or an error message"
            assert (op == ":?") == (name in SECRETS), name
            assert f"`{name}`" in docs, f"{name} is not documented in docs/deploy.md"
        for name in compose.build_args(raw):
            assert f"`{name}`" in docs, f"build argument {name} is not documented in docs/deploy.md"
    assert compose.build_args(compose.load(ROOT / "compose.yaml")) == BUILD_PASSTHROUGH


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_service_is_hardened(variant: str) -> None:
    for name, svc in services(variant).items():
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert not svc.get("privileged"), name
        assert svc.get("network_mode") in (None, "none"), name
        assert bool(svc.get("read_only")) is (name not in WRITABLE_ROOT), name
        assert set(svc.get("cap_add", [])) <= ({"CHOWN"} if name in ONE_SHOT else set()), name
        user = svc.get("user")
        if user is not None and name not in ONE_SHOT:
            assert user.split(":")[0] not in ("0", "root"), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_health_checks_and_healthy_dependencies(variant: str) -> None:
    all_services = services(variant)
    for name, svc in all_services.items():
        if name in ONE_SHOT:
            assert svc.get("restart") == "no"
            continue
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no health check"
        assert svc.get("restart") == "unless-stopped", name
        for dependency, condition in svc.get("depends_on", {}).items():
            expected = "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            assert condition["condition"] == expected, f"{name} -> {dependency}"
    crucible = [n for n, s in all_services.items() if s.get("image", "").startswith("crucible/")]
    for name in crucible:
        if set(mounts(all_services[name])) & {"models", "adapters", "runs"}:
            assert "volumes-init" in all_services[name]["depends_on"], name
    assert set(all_services["trainer"]["depends_on"]) >= {"redis", "generator", "sandbox-lb"}
    assert "redis" in all_services["gateway"]["depends_on"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_built_from_this_repository(variant: str) -> None:
    version = crucible_shared.__version__
    for name, svc in services(variant).items():
        image = svc["image"]
        if not image.startswith("crucible/"):
            assert "build" not in svc, name
            continue
        repository, _, tag = image.partition(":")
        assert tag == version, f"{name}: tag {tag}, package version {version}"
        dockerfile, _ = IMAGES[repository]
        build = svc["build"]
        context = Path(build["context"])
        assert context.is_dir(), name
        assert (context / build.get("dockerfile", "Dockerfile")).resolve() == (ROOT / dockerfile).resolve(), (
            name
        )
        if "vllm" not in dockerfile:
            assert build["secrets"] == [{"source": "pip-ca"}], name


def test_base_images_and_package_sources_come_from_the_environment() -> None:
    """deploy/base-images.sh and a package mirror: every image swaps without editing a file."""
    local = {var: f"crucible-base/{name}:test" for name, var in THIRD_PARTY.items()}
    env = {
        **SECRETS,
        **local,
        "PYTHON_IMAGE": "crucible-base/python:test",
        "PIP_INDEX_URL": "https://mirror.example/simple",
        "TORCH_CPU_INDEX_URL": "https://mirror.example/torch-cpu",
        "PIP_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt",
    }
    stack = compose.config(COMPOSE_FILES["cpu"], env)
    for name, var in THIRD_PARTY.items():
        assert stack["services"][name]["image"] == local[var]
    for name in ("gateway", "sandbox", "generator", "trainer"):
        args = stack["services"][name]["build"]["args"]
        assert args["PYTHON_IMAGE"] == "crucible-base/python:test", name
        assert args["PIP_INDEX_URL"] == "https://mirror.example/simple", name
        assert "PIP_NO_INDEX" not in args, f"{name}: an unset variable is not passed"
    for name in ("generator", "trainer"):
        assert (
            stack["services"][name]["build"]["args"]["TORCH_INDEX_URL"] == "https://mirror.example/torch-cpu"
        )
    assert stack["secrets"]["pip-ca"]["file"] == "/etc/ssl/certs/ca-certificates.crt"
    defaults = services("cpu")
    assert "args" not in defaults["gateway"]["build"], "nothing passed by default"
    assert compose_stack("cpu")["secrets"]["pip-ca"]["file"] == "/dev/null", "no CA by default"


def test_sandbox_is_contained() -> None:
    svc = services("gpu")["sandbox"]
    tmp = [t for t in svc["tmpfs"] if t.startswith("/tmp:")]
    assert tmp and {"noexec", "nosuid", "nodev"} <= set(tmp[0].split(":", 1)[1].split(","))
    limits = svc["deploy"]["resources"]["limits"]
    assert 0 < limits["pids"] <= 4096
    assert "pids_limit" not in svc, "Compose refuses pids_limit beside deploy limits"
    assert int(svc["deploy"]["replicas"]) >= 2
    assert limits["memory"] and limits["cpus"]
    networks = compose_stack("gpu")["networks"]
    assert list(svc["networks"]) == ["sandbox"] and networks["sandbox"]["internal"] is True, "no egress"
    assert "ports" not in svc, "reached through sandbox-lb"
    keys = svc["environment"]["CRUCIBLE_SANDBOX_API_KEYS"].split(",")
    assert SECRETS["CRUCIBLE_TRAINER_SANDBOX_API_KEY"] in keys
    assert svc["init"] is True, "an init reaps what runs leave behind"
    # Reduced mode: a run's RLIMIT_NPROC counts the whole uid (all replicas); the pids limit bounds it.
    assert int(svc["environment"]["CRUCIBLE_SANDBOX_PROCESSES"]) > limits["pids"]


def test_sandbox_load_balancer_is_the_published_entry() -> None:
    stack = compose_stack("gpu")
    lb = stack["services"]["sandbox-lb"]
    assert set(lb["networks"]) == {"backend", "sandbox"}
    assert published(lb) == [8002]
    config = stack["configs"][lb["configs"][0]["source"]]["content"]
    assert "bind :8002" in config
    assert "server-template sandbox 1-32 sandbox:8002 check resolvers docker" in config
    assert "option httpchk GET /health" in config
    trainer = stack["services"]["trainer"]["environment"]
    assert trainer["CRUCIBLE_TRAINER_SANDBOX_URL"] == "http://sandbox-lb:8002"


def test_gateway_is_published_with_keys_required() -> None:
    svc = services("gpu")["gateway"]
    assert published(svc) == [8000]
    assert svc["environment"]["CRUCIBLE_GATEWAY_API_KEYS"] == SECRETS["CRUCIBLE_GATEWAY_API_KEYS"]
    assert svc["environment"]["CRUCIBLE_GATEWAY_PRODUCTION"] == "true"
    assert all(ro for _, ro in mounts(svc).values()), "the gateway only reads run dirs and adapters"


@pytest.mark.parametrize("variant", VARIANTS)
def test_tenants_documents_are_mounted_where_the_services_look(variant: str) -> None:
    stack = compose_stack(variant)
    for name, prefix in (("gateway", "CRUCIBLE_GATEWAY"), ("sandbox", "CRUCIBLE_SANDBOX")):
        svc = stack["services"][name]
        (secret,) = [s for s in svc.get("secrets", []) if s["source"] == f"{name}-tenants"]
        target = secret.get("target") or f"/run/secrets/{secret['source']}"
        assert svc["environment"][f"{prefix}_TENANTS_FILE"] == target, name
        # None by default: an empty document (each key a tenant of its own), never a missing file.
        assert stack["secrets"][f"{name}-tenants"]["file"] == "/dev/null"
    custom = compose.config(COMPOSE_FILES[variant], {**SECRETS, "GATEWAY_TENANTS_FILE": "/etc/t.json"})
    assert custom["secrets"]["gateway-tenants"]["file"] == "/etc/t.json"


def test_redis_persists_its_data() -> None:
    svc = services("gpu")["redis"]
    command = svc["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert mounts(svc)["redis-data"] == ("/data", False)
    assert "ports" not in svc


def test_trainer_reads_datasets_from_a_host_folder() -> None:
    trainer = services("gpu")["trainer"]
    (source,) = [s for s, (target, _) in mounts(trainer).items() if target == "/data/datasets"]
    assert mounts(trainer)[source][1], "read-only"
    assert source == str(ROOT / "datasets"), "CRUCIBLE_DATASETS_DIR defaults to ./datasets"


@pytest.mark.parametrize("variant", VARIANTS)
def test_models_brought_as_folders_reach_generator_and_trainer_at_one_path(variant: str) -> None:
    # An air-gapped host (docs/deploy.md): GENERATOR_MODEL and a job's model.base name the same
    # /models/local/<name>, which lies inside the model roots (/models) the trainer image sets.
    stack = services(variant)
    for name in ("generator", "trainer"):
        svc = stack[name]
        (source,) = [s for s, (target, _) in mounts(svc).items() if target == "/models/local"]
        assert source == str(ROOT / "local-models") and mounts(svc)[source][1], name
        assert svc["environment"]["HF_HUB_OFFLINE"] == "0", f"{name}: HF_HUB_OFFLINE=1 turns the hub off"


def _gpu_devices(svc: dict) -> list[dict]:
    return svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_gpu_host_runs_vllm_and_the_trainer_on_gpus() -> None:
    stack = services("gpu")
    generator, trainer = stack["generator"], stack["trainer"]
    for svc in (generator, trainer):
        (device,) = _gpu_devices(svc)
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert device.get("device_ids") or device.get("count")
        assert svc["shm_size"]
    assert Path(generator["build"]["context"]) == ROOT / "services/generator/vllm"
    env = generator["environment"]
    assert env["HF_HOME"].startswith("/models/")
    assert mounts(generator)["models"] == ("/models", False)
    assert int(env["GENERATOR_MAX_LORAS"]) >= 2, "the new version loads while the old one serves"
    assert generator["healthcheck"]["test"][1] == "python3", "the vLLM image has python3, maybe no curl"
    assert not any(_gpu_devices(s) for n, s in stack.items() if n not in ("generator", "trainer"))


def test_cpu_override_swaps_in_crucibles_generator_and_a_cpu_trainer() -> None:
    stack = services("cpu")
    assert not any(_gpu_devices(svc) for svc in stack.values())
    generator = stack["generator"]
    assert generator["image"].startswith("crucible/generator:")
    assert generator["build"]["dockerfile"] == "services/generator/Dockerfile"
    assert Path(generator["build"]["context"]) == ROOT
    assert set(generator["environment"]) == {
        "CRUCIBLE_GENERATOR_MODEL",
        "CRUCIBLE_GENERATOR_MAX_LORAS",
        "CRUCIBLE_GENERATOR_MAX_LORA_RANK",
        "HF_TOKEN",
        "HF_HUB_OFFLINE",
    }
    trainer = stack["trainer"]
    assert trainer["image"].startswith("crucible/trainer-cpu:")
    for svc in (generator, trainer):
        assert svc["build"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    gpu = services("gpu")
    assert set(stack) == set(gpu), "the same stack"
    for name in ("redis", "gateway", "sandbox", "sandbox-lb"):
        assert stack[name] == gpu[name]


@pytest.mark.parametrize("variant", VARIANTS)
def test_generator_health_check_matches_its_image(variant: str) -> None:
    svc = services(variant)["generator"]
    dockerfile, _ = IMAGES[svc["image"].partition(":")[0]]
    assert "/health" in " ".join(svc["healthcheck"]["test"])
    if "vllm" not in dockerfile:
        assert any(i.keyword == "HEALTHCHECK" for i in docker.parse((ROOT / dockerfile).read_text()))
