"""The small readers the deployment tests rely on: Kustomize rendering, compose merging and
interpolation, Dockerfile parsing and .dockerignore matching."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy import compose, docker, kustomize


def write(path: Path, *docs: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump_all(docs))


def deployment(containers: list[dict], volumes: list[dict] | None = None) -> dict:
    spec = {"containers": containers, **({"volumes": volumes} if volumes else {})}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "app"},
        "spec": {"template": {"spec": spec}},
    }


def test_strategic_merge_by_key_with_new_items_first_and_null_deletes() -> None:
    base = {
        "containers": [{"name": "a", "image": "x:1", "env": [{"name": "A", "value": "1"}], "args": ["--x"]}],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "hostname": "h",
    }
    patch = {
        "containers": [
            {"name": "a", "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "3"}], "args": ["--y"]}
        ],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}, {"name": "tmp", "$patch": "delete"}],
        "hostname": None,
    }
    merged = kustomize.strategic_merge(base, patch)
    (container,) = merged["containers"]
    assert container["image"] == "x:1"
    assert container["env"] == [{"name": "B", "value": "2"}, {"name": "A", "value": "3"}]
    assert container["args"] == ["--y"], "lists without a merge key are replaced"
    assert merged["volumes"] == [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    assert "hostname" not in merged


def test_build_applies_patches_namespace_and_images(tmp_path: Path) -> None:
    write(
        tmp_path / "base/app.yaml",
        deployment([{"name": "a", "image": "org/app:1"}]),
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "ns"},
        },
    )
    write(tmp_path / "base/kustomization.yaml", {"namespace": "ns", "resources": ["app.yaml"]})
    write(tmp_path / "overlay/patch.yaml", deployment([{"name": "a", "env": [{"name": "X", "value": "1"}]}]))
    write(
        tmp_path / "overlay/kustomization.yaml",
        {
            "resources": ["../base"],
            "patches": [{"path": "patch.yaml"}],
            "images": [{"name": "org/app", "newName": "reg:5000/org/app", "newTag": "2"}],
        },
    )
    app, namespace = kustomize.build(tmp_path / "overlay")
    container = app["spec"]["template"]["spec"]["containers"][0]
    assert container == {"name": "a", "image": "reg:5000/org/app:2", "env": [{"name": "X", "value": "1"}]}
    assert app["metadata"]["namespace"] == "ns" and "namespace" not in namespace["metadata"]


def test_build_refuses_what_it_cannot_render(tmp_path: Path) -> None:
    write(tmp_path / "a/kustomization.yaml", {"resources": [], "commonLabels": {"x": "y"}})
    with pytest.raises(kustomize.KustomizeError, match="commonLabels"):
        kustomize.build(tmp_path / "a")
    write(tmp_path / "b/patch.yaml", deployment([{"name": "a"}]))
    write(tmp_path / "b/kustomization.yaml", {"resources": [], "patches": [{"path": "patch.yaml"}]})
    with pytest.raises(kustomize.KustomizeError, match="0 targets"):
        kustomize.build(tmp_path / "b")


@pytest.mark.parametrize(
    ("image", "parts"),
    [
        ("redis:7.4-alpine", ("redis", "7.4-alpine", None)),
        ("reg:5000/a/b", ("reg:5000/a/b", None, None)),
        ("a/b:1@sha256:abc", ("a/b", "1", "sha256:abc")),
    ],
)
def test_split_image(image: str, parts: tuple) -> None:
    assert kustomize.split_image(image) == parts


def test_compose_interpolation() -> None:
    env = {"SET": "v", "EMPTY": ""}
    cases = {
        "${SET}": "v",
        "$SET/x": "v/x",
        "${UNSET}": "",
        "${UNSET:-d}": "d",
        "${EMPTY:-d}": "d",
        "${EMPTY-d}": "",
        "${SET:?boom}": "v",
        "${SET:+alt}": "alt",
        "${UNSET:+alt}": "",
        "$$HOME": "$HOME",
    }
    for text, expected in cases.items():
        assert compose.interpolate(text, env) == expected, text
    with pytest.raises(compose.MissingVariable, match="EMPTY: needed"):
        compose.interpolate({"a": ["${EMPTY:?needed}"]}, env)
    assert compose.variables({"a": "${A:-1} ${B:?x} $C", "b": "$$D"}) == {"A": ":-", "B": ":?", "C": None}


def test_compose_merge_tags(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(
        "services:\n  s:\n    image: a\n    environment: {A: '1', B: '2'}\n    ports: ['1:1']\n"
        "    deploy: {resources: {reservations: {devices: [{capabilities: [gpu]}]}, limits: {cpus: '1'}}}\n"
    )
    (tmp_path / "over.yaml").write_text(
        "services:\n  s:\n    image: b\n    environment: !override {C: '3'}\n    ports: !override ['2:2']\n"
        "    deploy: {resources: {reservations: {devices: !reset []}}}\n"
    )
    merged = compose.resolve([tmp_path / "base.yaml", tmp_path / "over.yaml"], {})
    assert merged["services"]["s"] == {
        "image": "b",
        "environment": {"C": "3"},
        "ports": ["2:2"],
        "deploy": {"resources": {"reservations": {}, "limits": {"cpus": "1"}}},
    }
    (tmp_path / "untagged.yaml").write_text("services:\n  s:\n    ports: ['3:3']\n")
    with pytest.raises(ValueError, match="ports"):
        compose.resolve([tmp_path / "base.yaml", tmp_path / "untagged.yaml"], {})


DOCKERFILE = """\
# syntax=docker/dockerfile:1
FROM python:3.11-slim AS build
COPY a b /src/
FROM python:3.11-slim
ENV A=1 \\
    # a comment inside a continuation
    B="two words"
ENV LEGACY value here
COPY --from=build /src /src
COPY --chmod=0755 <<'SCRIPT' /usr/local/bin/x
#!/bin/sh
echo hi
SCRIPT
CMD ["python", "-m", "x"]
"""


def test_dockerfile_parsing() -> None:
    instructions = docker.parse(DOCKERFILE)
    assert [i.keyword for i in instructions] == ["FROM", "COPY", "FROM", "ENV", "ENV", "COPY", "COPY", "CMD"]
    assert docker.copy_sources(instructions[1]) == ["a", "b"]
    assert docker.copy_sources(instructions[5]) == [] and docker.copy_sources(instructions[6]) == []
    assert instructions[6].heredocs == ["#!/bin/sh\necho hi\n"]
    assert docker.env(docker.final_stage(instructions)) == {
        "A": "1",
        "B": "two words",
        "LEGACY": "value here",
    }
    assert docker.words(instructions[-1].args) == ["python", "-m", "x"]


def test_dockerignore_matching() -> None:
    ignore = docker.DockerIgnore("*\n!shared/\n!data/a.txt\n**/__pycache__/\n*.md\n!keep.md\n")
    assert ignore.excluded("README.md") and ignore.excluded(".venv/bin/python")
    assert not ignore.excluded("shared/pkg/mod.py")
    assert ignore.excluded("shared/pkg/__pycache__/mod.pyc")
    assert not ignore.excluded("data/a.txt") and ignore.excluded("data/b.txt")
    assert not ignore.excluded("keep.md")
