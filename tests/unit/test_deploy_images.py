"""Images: one slim, non-root Dockerfile per service, with a health check and only its own packages."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.deploy import docker
from tests.deploy.stack import ROOT

SERVICES = {
    # service: (Dockerfile, command module, port or None for the worker)
    "gateway": ("services/gateway/Dockerfile", "crucible_gateway", 8000),
    "sandbox": ("services/sandbox/Dockerfile", "crucible_sandbox", 8002),
    "generator": ("services/generator/Dockerfile", "crucible_generator", 8001),
    "trainer": ("services/trainer/Dockerfile", "crucible_trainer.worker", None),
}
VLLM = ROOT / "services/generator/vllm/Dockerfile"
HEAVY = {"torch", "transformers", "peft", "accelerate", "trl", "vllm"}


def instructions(path: str | Path) -> list[docker.Instruction]:
    return docker.parse((ROOT / path).read_text())


def final(path: str | Path, keyword: str) -> list[docker.Instruction]:
    return [i for i in docker.final_stage(instructions(path)) if i.keyword == keyword]


@pytest.mark.parametrize("service", SERVICES)
def test_runs_as_an_unprivileged_user(service: str) -> None:
    path = SERVICES[service][0]
    users = final(path, "USER")
    assert users, f"{path}: no USER in the final stage"
    uid = users[-1].args.split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, "numeric, so runAsNonRoot can verify it"


@pytest.mark.parametrize("service", SERVICES)
def test_runs_its_service_and_checks_its_health(service: str) -> None:
    path, module, port = SERVICES[service]
    (cmd,) = final(path, "CMD")
    assert docker.words(cmd.args)[:3] == ["python", "-m", module]
    (health,) = final(path, "HEALTHCHECK")
    assert "curl" not in health.args and "wget" not in health.args, "slim images have neither"
    if port is None:
        assert "crucible-worker-health" in health.args
        return
    assert "/health" in health.args and "python" in health.args
    assert str(port) in health.args
    assert [e.args for e in final(path, "EXPOSE")] == [str(port)]
    prefix = f"CRUCIBLE_{service.upper()}_"
    image_env = docker.env(docker.final_stage(instructions(path)))
    assert image_env[prefix + "PORT"] == str(port)
    assert image_env[prefix + "HOST"] == "0.0.0.0", "reachable from outside the container"


@pytest.mark.parametrize("service", SERVICES)
def test_installs_shared_then_only_its_own_package(service: str) -> None:
    path = SERVICES[service][0]
    runs = " ".join(i.args for i in instructions(path) if i.keyword == "RUN")
    installed = re.findall(r"/src/(shared|services/[a-z]+)", runs)
    assert installed == ["shared", f"services/{service}"]
    assert "-e " not in runs and "--editable" not in runs, "no editable installs in images"
    copies = [s for i in instructions(path) if i.keyword == "COPY" for s in docker.copy_sources(i)]
    assert not [s for s in copies if s.startswith("services/") and s != f"services/{service}"]


def test_sandbox_has_a_uid_of_its_own() -> None:
    """RLIMIT_NPROC counts every process of a uid: runs sharing one with the generator's threads
    could not fork (docs/deploy.md, "The sandbox")."""
    uids = {s: final(p, "USER")[-1].args.split(":")[0] for s, (p, _, _) in SERVICES.items()}
    assert uids["sandbox"] not in {u for s, u in uids.items() if s != "sandbox"}


def test_base_image_helper_names_what_compose_and_the_compose_test_use() -> None:
    """deploy/base-images.sh parses, and prints the variables compose reads and the test sets."""
    script = ROOT / "deploy/base-images.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    built = dict(re.findall(r"\[([A-Z_]+)\]=(crucible-base/\S+)", script.read_text()))
    assert set(built) == {"PYTHON_IMAGE", "REDIS_IMAGE", "SANDBOX_LB_IMAGE", "INIT_IMAGE"}
    test = (ROOT / "deploy/compose_test.py").read_text()
    for variable, image in built.items():
        assert f'"{variable}": "{image}"' in test, variable
        assert f"${{{variable}" in (ROOT / "compose.yaml").read_text() or variable == "PYTHON_IMAGE"
    assert "ARG PYTHON_IMAGE=" in (ROOT / SERVICES["gateway"][0]).read_text()


def _dependencies(pyproject: Path, extras: set[str]) -> set[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = list(project.get("dependencies", []))
    for extra in extras:
        deps += project.get("optional-dependencies", {}).get(extra, [])
    names = set()
    for dep in deps:
        name, extra_part = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", dep).groups()
        name = name.lower().replace("_", "-")
        if name == "crucible-shared":
            names |= {name} | _dependencies(
                ROOT / "shared/pyproject.toml", set((extra_part or "").split(",")) - {""}
            )
        else:
            names.add(name)
    return names


@pytest.mark.parametrize("service", ["gateway", "sandbox"])
def test_sandbox_and_gateway_never_pull_torch(service: str) -> None:
    deps = _dependencies(ROOT / f"services/{service}/pyproject.toml", set())
    assert not deps & HEAVY
    runs = " ".join(i.args for i in instructions(SERVICES[service][0]) if i.keyword == "RUN").lower()
    assert not HEAVY & set(re.findall(r"[a-z]+", runs))


def test_model_images_pin_torch_and_their_index() -> None:
    generator = (ROOT / SERVICES["generator"][0]).read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in generator
    trainer = (ROOT / SERVICES["trainer"][0]).read_text()
    assert "ARG TORCH_INDEX_URL=https://pypi.org/simple" in trainer, "PyPI's Linux wheel is the CUDA build"
    for text in (generator, trainer):
        assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+", text)
        assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in text
    # TRL (SFT / DPO) comes with the trainer package the image installs.
    assert "/src/services/trainer" in trainer
    assert {"trl", "datasets"} <= _dependencies(ROOT / "services/trainer/pyproject.toml", set())
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    if pinned:
        assert f"ARG TORCH_VERSION={pinned[1]}" in trainer, "same torch as the development environment"


def test_trainer_image_carries_the_vendored_data() -> None:
    env = docker.env(docker.final_stage(instructions(SERVICES["trainer"][0])))
    copies = [i for i in final(SERVICES["trainer"][0], "COPY") if "data/mbpp.jsonl" in i.args]
    assert copies and docker.words(copies[0].args)[-1].rstrip("/") == env["CRUCIBLE_DATA_DIR"]


def test_worker_health_script_is_python_that_compiles() -> None:
    (copy,) = [
        i for i in instructions(SERVICES["trainer"][0]) if i.keyword == "COPY" and "worker-health" in i.args
    ]
    (source,) = docker.copy_sources(copy)
    compile((ROOT / source).read_text(), "crucible-worker-health", "exec")
    assert "--chmod=0755" in copy.args
    assert docker.words(copy.args)[-1] == "/usr/local/bin/crucible-worker-health"


@pytest.mark.parametrize("dockerfile", [p for p, _, _ in SERVICES.values()])
def test_builds_without_a_registry_on_docker_20_10(dockerfile: str) -> None:
    """No `# syntax=` line (BuildKit would pull its frontend from Docker Hub) and no here-documents
    (the frontend built into Docker 20.10, Debian 12's docker.io, does not know them)."""
    text = (ROOT / dockerfile).read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M)
    assert not any(i.heredocs for i in instructions(dockerfile))


@pytest.mark.parametrize("dockerfile", [p for p, _, _ in SERVICES.values()])
def test_pip_gets_the_mirror_the_wheelhouse_and_the_proxy_ca(dockerfile: str) -> None:
    """docs/deploy.md, "Building behind a proxy or offline": every pip call sees all three."""
    build = [i for i in instructions(dockerfile) if i.stage == 0]
    args = {i.args.split("=")[0] for i in build if i.keyword == "ARG"}
    assert {"PIP_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_NO_INDEX"} <= args
    assert docker.env(build)["PIP_FIND_LINKS"] == "/wheels"
    pip_runs = [i.args for i in build if i.keyword == "RUN" and "pip install" in i.args]
    assert pip_runs
    for run in pip_runs:
        assert "--mount=type=secret,id=pip-ca" in run
        assert "--mount=type=bind,source=deploy/wheels,target=/wheels" in run
        assert "PIP_CERT=/run/secrets/pip-ca" in run
    assert (ROOT / "deploy/wheels/README.md").exists()


def test_vllm_image_is_the_generator_on_gpus() -> None:
    (base,) = [i.args for i in instructions(VLLM) if i.keyword == "FROM"]
    assert base.startswith("vllm/vllm-openai:")
    env = docker.env(instructions(VLLM))
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    serve = (VLLM.parent / "serve.sh").read_text()
    for flag in ("--enable-lora", "--max-loras", "--max-lora-rank"):
        assert flag in serve


def _dockerfiles() -> list[Path]:
    return [ROOT / p for p, _, _ in SERVICES.values()] + [VLLM]


def _context_and_ignore(dockerfile: Path) -> tuple[Path, docker.DockerIgnore]:
    """Build context and the ignore file BuildKit applies (`<Dockerfile>.dockerignore` first)."""
    context = VLLM.parent if dockerfile == VLLM else ROOT
    for candidate in (dockerfile.with_name(dockerfile.name + ".dockerignore"), context / ".dockerignore"):
        if candidate.exists():
            return context, docker.DockerIgnore.read(candidate)
    return context, docker.DockerIgnore("")


@pytest.mark.parametrize("dockerfile", _dockerfiles(), ids=lambda p: str(p.relative_to(ROOT)))
def test_copied_files_exist_in_the_build_context(dockerfile: Path) -> None:
    context, ignore = _context_and_ignore(dockerfile)
    for instruction in instructions(dockerfile):
        if instruction.keyword not in ("COPY", "ADD"):
            continue
        for source in docker.copy_sources(instruction):
            assert (context / source).exists(), f"{dockerfile}: {source} is missing"
            assert not ignore.excluded(source), f"{dockerfile}: {source} is excluded from the context"
            if (context / source).is_dir():
                kept = [
                    p
                    for p in (context / source).rglob("*")
                    if p.is_file() and not ignore.excluded(str(p.relative_to(context)))
                ]
                assert kept, f"{dockerfile}: nothing of {source} reaches the context"


@pytest.mark.parametrize("service", SERVICES)
def test_build_context_is_narrow(service: str) -> None:
    _, ignore = _context_and_ignore(ROOT / SERVICES[service][0])
    for path in (".venv/bin/python", ".git/HEAD", "runs/jobs/x", "tests/unit/test_x.py", "README.md"):
        assert ignore.excluded(path), path
    for path in ("shared/crucible_shared/__pycache__/x.pyc", f"services/{service}/x.egg-info/PKG-INFO"):
        assert ignore.excluded(path), path
    others = [s for s in SERVICES if s != service]
    assert all(ignore.excluded(f"services/{other}/pyproject.toml") for other in others)
    assert ignore.excluded("services/generator/vllm/serve.sh")
    root = docker.DockerIgnore.read(ROOT / ".dockerignore")
    assert not root.excluded(f"services/{service}/pyproject.toml") and root.excluded(".venv/bin/python")
