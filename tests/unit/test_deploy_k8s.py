"""k8s/: both overlays render, every object validates against the Kubernetes schemas, and the
workloads are hardened, probed, sized and wired as docs/deploy.md says."""

from __future__ import annotations

import os
from pathlib import PurePosixPath

import crucible_shared
import kubernetes_validate
import pytest
import yaml

from tests.deploy import kubectl
from tests.deploy.env import IMAGES
from tests.deploy.stack import OVERLAYS, ROOT, find, k8s_objects, workloads

K8S_VERSION = "1.33"
VARIANTS = ["gpu", "cpu"]
SECRET = "crucible-api-keys"
REQUIRED_SECRET_KEYS = {
    "gateway-api-keys",
    "sandbox-api-keys",
    "trainer-sandbox-key",
    "gateway-tenants",
    "sandbox-tenants",
}
OPTIONAL_SECRET_KEYS = {"hf-token", "wandb-api-key"}


def _key(obj: dict) -> tuple:
    return obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_overlay_renders(variant: str) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in k8s_objects(variant)}
    for name in ("gateway", "sandbox", "trainer"):
        assert ("Deployment", name) in kinds and ("ServiceAccount", name) in kinds
    for name in ("generator", "redis"):
        assert ("StatefulSet", name) in kinds and ("ServiceAccount", name) in kinds
    assert {
        ("HorizontalPodAutoscaler", "sandbox"),
        ("NetworkPolicy", "sandbox"),
        ("Ingress", "crucible"),
    } <= kinds
    assert all(
        o["metadata"].get("namespace") == "crucible" for o in k8s_objects(variant) if o["kind"] != "Namespace"
    )


def test_kubectl_refuses_a_broken_overlay(tmp_path) -> None:
    """Rendering is kubectl's own: a patch that matches nothing fails the render."""
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(OVERLAYS['cpu'], tmp_path)}]\npatches:\n  - target: {{kind: Deployment, name: nothing}}\n"
        "    patch: '[{op: add, path: /spec/replicas, value: 2}]'\n"
    )
    with pytest.raises(kubectl.KustomizeError, match="nothing"):
        kubectl.kustomize(tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_against_the_kubernetes_schema(variant: str) -> None:
    for obj in k8s_objects(variant):
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")


def test_schema_validation_catches_a_misspelt_field() -> None:
    deployment = yaml.safe_load(yaml.safe_dump(find("gpu", "Deployment", "gateway")))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_is_restricted(variant: str) -> None:
    """The `restricted` Pod Security Standard the namespace enforces, plus read-only roots."""
    namespace = find(variant, "Namespace", "crucible")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    accounts = {o["metadata"]["name"]: o for o in k8s_objects(variant) if o["kind"] == "ServiceAccount"}
    for obj, spec in workloads(variant):
        name = obj["metadata"]["name"]
        assert spec["serviceAccountName"] in accounts, name
        assert accounts[spec["serviceAccountName"]]["automountServiceAccountToken"] is False
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["enableServiceLinks"] is False, f"{name}: service links inject GENERATOR_PORT=tcp://..."
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] >= 999, name
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", name
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        for volume in spec.get("volumes", []):
            assert set(volume) & {"emptyDir", "persistentVolumeClaim", "secret", "configMap"}, volume
        for container in spec["containers"] + spec.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["capabilities"] == {"drop": ["ALL"]}, name
            assert not ctx.get("privileged"), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_has_probes_and_resources(variant: str) -> None:
    for obj, spec in workloads(variant):
        for container in spec["containers"]:
            name = f"{obj['metadata']['name']}/{container['name']}"
            assert "livenessProbe" in container, name
            assert "readinessProbe" in container or obj["metadata"]["name"] == "trainer", name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), f"{name} {kind}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                http = container.get(probe, {}).get("httpGet")
                if http:
                    assert http["path"] == "/health", name
                    assert http["port"] in [p["name"] for p in container["ports"]], name


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_ours_and_versioned(variant: str) -> None:
    for _, spec in workloads(variant):
        for container in spec["containers"]:
            name, tag, _ = kubectl.split_image(container["image"])
            if name.startswith("crucible/"):
                assert name in IMAGES, name
                assert tag == crucible_shared.__version__, container["image"]
                assert container["imagePullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_select_workloads_and_named_ports(variant: str) -> None:
    pods = {}
    for _, spec in workloads(variant):
        for container in spec["containers"]:
            pods[spec["serviceAccountName"]] = {p["name"] for p in container.get("ports", [])}
    for obj in k8s_objects(variant):
        if obj["kind"] != "Service":
            continue
        target = obj["spec"]["selector"]["app.kubernetes.io/name"]
        assert target in pods, obj["metadata"]["name"]
        for port in obj["spec"]["ports"]:
            assert port["targetPort"] in pods[target]


@pytest.mark.parametrize("variant", VARIANTS)
def test_sandbox_pods_run_as_the_sandbox_images_own_uid(variant: str) -> None:
    """A run's RLIMIT_NPROC counts its uid on the whole node: not the generator's or trainer's."""
    uids = {obj["metadata"]["name"]: spec["securityContext"]["runAsUser"] for obj, spec in workloads(variant)}
    assert uids["sandbox"] == 10002 and uids["sandbox"] not in {u for n, u in uids.items() if n != "sandbox"}
    container = find(variant, "Deployment", "sandbox")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["CRUCIBLE_SANDBOX_PROCESSES"]) >= 1024


def test_sandbox_scales_and_has_no_egress() -> None:
    deployment = find("gpu", "Deployment", "sandbox")
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    hpa = find("gpu", "HorizontalPodAutoscaler", "sandbox")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sandbox"}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"], "the autoscaler measures utilisation of the request"
    policy = find("gpu", "NetworkPolicy", "sandbox")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Egress" in policy["spec"]["policyTypes"] and policy["spec"]["egress"] == []
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [8002]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert volumes[tmp["name"]]["emptyDir"]["medium"] == "Memory"


def _resources(variant: str, kind: str, name: str) -> dict:
    return find(variant, kind, name)["spec"]["template"]["spec"]["containers"][0]["resources"]


def test_gpu_overlay_runs_vllm_and_trainers_on_gpus() -> None:
    generator = find("gpu", "StatefulSet", "generator")
    spec = generator["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["image"].startswith("crucible/generator-vllm:")
    for kind, name in (("StatefulSet", "generator"), ("Deployment", "trainer")):
        resources = _resources("gpu", kind, name)
        assert resources["limits"]["nvidia.com/gpu"] == "1", name
        tolerations = find("gpu", kind, name)["spec"]["template"]["spec"]["tolerations"]
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations), name
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    (volume,) = [v for v in spec["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800, "model load + compile"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GENERATOR_MODEL"] and int(env["GENERATOR_MAX_LORAS"]) >= 2


def test_cpu_overlay_has_no_gpus() -> None:
    for _, spec in workloads("cpu"):
        for container in spec["containers"]:
            assert "nvidia.com/gpu" not in str(container["resources"])
        assert not spec.get("tolerations")
    generator = find("cpu", "StatefulSet", "generator")["spec"]["template"]["spec"]["containers"][0]
    assert generator["image"].startswith("crucible/generator:")
    trainer = find("cpu", "Deployment", "trainer")["spec"]["template"]["spec"]["containers"][0]
    assert trainer["image"].startswith("crucible/trainer-cpu:")


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_broadcasts_to_every_generator_replica(variant: str) -> None:
    generator = find(variant, "StatefulSet", "generator")
    service = find(variant, "Service", generator["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "headless: one DNS name per replica"
    port = service["spec"]["ports"][0]["port"]
    trainer = find(variant, "Deployment", "trainer")["spec"]["template"]["spec"]["containers"][0]
    urls = next(e["value"] for e in trainer["env"] if e["name"] == "CRUCIBLE_TRAINER_GENERATOR_URLS")
    expected = [
        f"http://generator-{i}.{service['metadata']['name']}:{port}"
        for i in range(generator["spec"]["replicas"])
    ]
    assert urls.split(",") == expected


@pytest.mark.parametrize("variant", VARIANTS)
def test_shared_volumes(variant: str) -> None:
    claims = {o["metadata"]["name"]: o for o in k8s_objects(variant) if o["kind"] == "PersistentVolumeClaim"}
    mounts: dict[str, dict[str, tuple[str, bool]]] = {}
    for obj, spec in workloads(variant):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in spec["containers"][0]["volumeMounts"]:
            claim = volumes.get(m["name"], {}).get("persistentVolumeClaim")
            if claim:
                assert claim["claimName"] in claims
                mounts.setdefault(claim["claimName"], {})[obj["metadata"]["name"]] = (
                    m["mountPath"],
                    bool(m.get("readOnly")),
                )
    for claim in ("crucible-adapters", "crucible-runs", "crucible-models"):
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"], claim
    assert mounts["crucible-adapters"] == {
        "trainer": ("/data/adapters", False),
        "generator": ("/data/adapters", True),
        "gateway": ("/data/adapters", True),
    }, "adapters are loaded by the path the trainer wrote them to"
    assert mounts["crucible-runs"] == {"trainer": ("/data/runs", False), "gateway": ("/data/runs", True)}


def test_redis_is_a_statefulset_with_a_volume_and_persistence() -> None:
    redis = find("gpu", "StatefulSet", "redis")
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/data"] == [
        claim["metadata"]["name"]
    ]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"


@pytest.mark.parametrize("variant", VARIANTS)
def test_keys_come_from_one_secret(variant: str) -> None:
    used: dict[str, bool] = {}
    for _, spec in workloads(variant):
        for container in spec["containers"]:
            assert "envFrom" not in container
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == SECRET
                    used[ref["key"]] = bool(ref.get("optional"))
                elif "KEY" in env["name"] or "TOKEN" in env["name"]:
                    pytest.fail(f"{env['name']} must come from the Secret")
        for volume in spec.get("volumes", []):
            if "secret" in volume and volume["secret"]["secretName"] != "crucible-tls":
                assert volume["secret"]["secretName"] == SECRET
                for item in volume["secret"]["items"]:
                    used[item["key"]] = bool(volume["secret"].get("optional"))
    assert {k for k, optional in used.items() if not optional} == REQUIRED_SECRET_KEYS
    assert {k for k, optional in used.items() if optional} <= OPTIONAL_SECRET_KEYS
    docs = (ROOT / "docs/deploy.md").read_text()
    for key in REQUIRED_SECRET_KEYS | OPTIONAL_SECRET_KEYS:
        assert f"{key}=" in docs, f"docs/deploy.md does not show how to set {key}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_tenants_documents_are_mounted_where_the_services_look(variant: str) -> None:
    for name, prefix in (("gateway", "CRUCIBLE_GATEWAY"), ("sandbox", "CRUCIBLE_SANDBOX")):
        spec = find(variant, "Deployment", name)["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        (volume,) = [v for v in spec["volumes"] if v["name"] == "tenants"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tenants"]
        (item,) = volume["secret"]["items"]
        assert item["key"] == f"{name}-tenants" and mount["readOnly"]
        assert env[f"{prefix}_TENANTS_FILE"] == f"{mount['mountPath']}/{item['path']}"
        assert volume["secret"]["defaultMode"] & 0o007 == 0, "not readable by other users"


def test_ingress_routes_to_the_gateway_and_the_sandbox() -> None:
    ingress = find("gpu", "Ingress", "crucible")
    backends = {
        path["backend"]["service"]["name"]: path["backend"]["service"]["port"]["name"]
        for rule in ingress["spec"]["rules"]
        for path in rule["http"]["paths"]
    }
    assert backends == {"gateway": "http", "sandbox": "http"}
    for name, port in backends.items():
        assert port in [p["name"] for p in find("gpu", "Service", name)["spec"]["ports"]]
    assert ingress["spec"]["tls"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_local_models_component_mounts_model_folders_where_jobs_name_them(variant: str, tmp_path) -> None:
    # An air-gapped cluster (docs/deploy.md): model folders read-only at /models/local, inside the
    # model roots, in every generator and trainer, and no hub calls.
    component = ROOT / "k8s/components/local-models"
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(OVERLAYS[variant], tmp_path)}]\n"
        f"components: [{os.path.relpath(component, tmp_path)}]\n"
    )
    objects = kubectl.kustomize(tmp_path)
    claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert "crucible-local-models" in {c["metadata"]["name"] for c in claims}
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    patched = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    for name in ("generator", "trainer"):
        spec = patched[name]["spec"]["template"]["spec"]
        (container,) = [c for c in spec["containers"] if c["name"] == name]
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/models/local")
        assert mount["readOnly"] is True
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["persistentVolumeClaim"]["claimName"] == "crucible-local-models"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HUB_OFFLINE"] == "1", name
        if name == "trainer":
            roots = env.get("CRUCIBLE_MODEL_ROOTS") or _image_env("trainer")["CRUCIBLE_MODEL_ROOTS"]
            assert any(PurePosixPath("/models/local").is_relative_to(r) for r in roots.split(","))
    assert {o["metadata"]["name"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")} == {
        o["metadata"]["name"] for o in k8s_objects(variant) if o["kind"] in ("Deployment", "StatefulSet")
    }


def _image_env(name: str) -> dict[str, str]:
    from tests.deploy import docker

    dockerfile, _ = IMAGES[f"crucible/{name}"]
    return docker.env(docker.final_stage(docker.parse((ROOT / dockerfile).read_text())))


def test_multi_gpu_overlay_gives_the_trainer_pod_four_gpus() -> None:
    objects = kubectl.kustomize(ROOT / "k8s/overlays/gpu-multi")
    trainer = _named(objects, "Deployment", "trainer")
    (container,) = trainer["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    generator = _named(objects, "StatefulSet", "generator")
    assert (
        generator["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    )
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_multinode_job_runs_torchrun_with_a_rendezvous_at_pod_zero() -> None:
    objects = kubectl.kustomize(ROOT / "k8s/multinode")
    job = _named(objects, "Job", "trainer-ranks")
    service = _named(objects, "Service", "trainer-ranks")
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    pod = job["spec"]["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in command and "--nnodes=2" in command
    assert "--rdzv-endpoint=trainer-ranks-0.trainer-ranks:29400" in command
    assert command[command.index("-m", 3) + 1] == "crucible_trainer.distributed.rank"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert pod["securityContext"]["runAsNonRoot"] and job["metadata"]["namespace"] == "crucible"


def _named(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)
