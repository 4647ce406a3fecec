"""A small Kustomize renderer for the features `k8s/` uses, so the tests run where kubectl is missing.

Supported in a kustomization: `resources` (manifest files and directories holding a kustomization),
`namespace`, `images` (`name` -> `newName` / `newTag` / `digest`) and `patches` given by `path`,
holding strategic-merge patches that name their target by kind and name. Any other field raises,
so a kustomization using more than this cannot be rendered wrong in silence. Where kubectl is
installed the tests check that this renderer and `kubectl kustomize` agree.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}

CLUSTER_SCOPED = {
    "Namespace",
    "PersistentVolume",
    "StorageClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "IngressClass",
    "PriorityClass",
    "RuntimeClass",
    "CustomResourceDefinition",
}

# Strategic-merge keys of the Kubernetes lists a patch may merge into (x-kubernetes-patch-merge-key).
# Lists not named here are replaced by the patch, as Kubernetes does for lists without a merge key.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not support, or a patch has no target."""


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def build(directory: Path) -> list[dict[str, Any]]:
    """Render the kustomization in `directory` into a list of objects."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects.extend(build(path) if path.is_dir() else load_documents(path))
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise KustomizeError(f"{directory}: only `patches: - path: ...` is supported, got {patch}")
        for doc in load_documents(directory / patch["path"]):
            index = _target(objects, doc, directory / patch["path"])
            objects[index] = strategic_merge(objects[index], doc)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def _target(objects: list[dict[str, Any]], patch: dict[str, Any], where: Path) -> int:
    meta = patch.get("metadata", {})
    matches = [
        i
        for i, obj in enumerate(objects)
        if obj["kind"] == patch["kind"]
        and _group(obj["apiVersion"]) == _group(patch["apiVersion"])
        and obj["metadata"]["name"] == meta["name"]
        and meta.get("namespace") in (None, obj["metadata"].get("namespace"))
    ]
    if len(matches) != 1:
        raise KustomizeError(f"{where}: {len(matches)} targets for {patch['kind']}/{meta['name']}")
    return matches[0]


def strategic_merge(base: Any, patch: Any) -> Any:
    """`patch` merged into `base`: maps recursively, lists by their merge key, `null` deletes."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    merged = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = _merge_list(merged[key], value, MERGE_KEYS[key])
        elif key == "ports" and isinstance(value, list) and isinstance(merged.get(key), list):
            merge_key = "containerPort" if all("containerPort" in p for p in value) else "port"
            merged[key] = _merge_list(merged[key], value, merge_key)
        else:
            merged[key] = strategic_merge(merged.get(key), value)
    return merged


def _merge_list(base: list[Any], patch: list[Any], key: str) -> list[Any]:
    """Items of `base` merged with their patch in place; new items first, as Kustomize orders them."""
    merged = copy.deepcopy(base)
    added = []
    for item in patch:
        found = next((i for i, old in enumerate(merged) if old.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if found is not None:
                del merged[found]
        elif found is None:
            added.append(copy.deepcopy(item))
        else:
            merged[found] = strategic_merge(merged[found], item)
    return added + merged


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """`registry:5000/a/b:tag@sha256:...` -> (`registry:5000/a/b`, `tag`, `sha256:...`)."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1 :], digest or None
    return name, None, digest or None


def _set_image(node: Any, rule: dict[str, str]) -> None:
    if isinstance(node, list):
        for item in node:
            _set_image(item, rule)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                name, tag, digest = split_image(container["image"])
                if name != rule["name"]:
                    continue
                name = rule.get("newName", name)
                tag = rule.get("newTag", tag)
                digest = rule.get("digest", digest)
                container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
        else:
            _set_image(value, rule)
