"""The deployments under test, loaded once: compose stacks as Docker Compose resolves them and
Kubernetes overlays as `kubectl kustomize` renders them."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.deploy import compose, kubectl

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = {
    "gpu": [ROOT / "compose.yaml"],
    "cpu": [ROOT / "compose.yaml", ROOT / "compose.cpu.yaml"],
}
OVERLAYS = {"gpu": ROOT / "k8s/overlays/gpu", "cpu": ROOT / "k8s/overlays/cpu"}

# The secrets compose requires, as a user's .env would hold them.
SECRETS = {
    "CRUCIBLE_GATEWAY_API_KEYS": "gateway-key-0123456789abcdef",
    "CRUCIBLE_TRAINER_SANDBOX_API_KEY": "trainer-key-0123456789abcdef",
}


@functools.cache
def compose_stack(variant: str) -> dict[str, Any]:
    return compose.config(COMPOSE_FILES[variant], SECRETS)


@functools.cache
def k8s_objects(variant: str) -> tuple[dict[str, Any], ...]:
    return tuple(kubectl.kustomize(OVERLAYS[variant]))


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod template's spec of a workload, None for other kinds."""
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def workloads(variant: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod spec) of every workload of an overlay."""
    for obj in k8s_objects(variant):
        spec = pod_spec(obj)
        if spec is not None:
            yield obj, spec


def find(variant: str, kind: str, name: str) -> dict[str, Any]:
    return next(o for o in k8s_objects(variant) if o["kind"] == kind and o["metadata"]["name"] == name)
