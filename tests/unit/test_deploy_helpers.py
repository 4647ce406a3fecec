"""The small readers the deployment tests rely on: compose variables and build arguments, image
names, Dockerfile parsing and .dockerignore matching."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.deploy import compose, docker, kubectl


@pytest.mark.parametrize(
    ("image", "parts"),
    [
        ("redis:7.4-alpine", ("redis", "7.4-alpine", None)),
        ("reg:5000/a/b", ("reg:5000/a/b", None, None)),
        ("a/b:1@sha256:abc", ("a/b", "1", "sha256:abc")),
    ],
)
def test_split_image(image: str, parts: tuple) -> None:
    assert kubectl.split_image(image) == parts


def test_compose_variables_and_passed_build_args() -> None:
    assert compose.variables({"a": "${A:-1} ${B:?x} $C", "b": "$$D"}) == {"A": ":-", "B": ":?", "C": None}
    raw = {
        "x-build": {"args": ["FROM_X", "SET=1"]},
        "services": {"s": {"build": {"args": ["FROM_S", "T=${T:-2}"]}}, "t": {"image": "i"}},
    }
    assert compose.build_args(raw) == {"FROM_X", "FROM_S"}


def test_compose_tags_load_as_plain_values(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("services:\n  s:\n    ports: !reset []\n    environment: !override {A: '1'}\n")
    assert compose.load(path) == {"services": {"s": {"ports": [], "environment": {"A": "1"}}}}


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


def test_any_containment_of_a_fork_bomb_passes_the_compose_check() -> None:
    path = Path(__file__).resolve().parents[2] / "deploy" / "compose_test.py"
    spec = importlib.util.spec_from_file_location("compose_test", path)
    assert spec and spec.loader
    compose_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compose_test)

    def results(fork_bomb: str, benign: str = "passed") -> list[dict]:
        out = []
        for name, (_, _, allowed) in compose_test.HOSTILE.items():
            status = (
                fork_bomb
                if name == "fork_bomb"
                else sorted(compose_test.REDUCED_MODE_ALLOWED.get(name, allowed))[0]
            )
            out += [{"status": status, "message": "m"}, {"status": benign}]
        return out

    for contained in ("timeout", "error", "memory_exceeded", "output_exceeded"):
        statuses, problems = compose_test.hostile_verdicts(results(contained))
        assert problems == [] and statuses["fork_bomb"] == contained
    for escaped in ("passed", "failed", "sandbox_error"):
        assert compose_test.hostile_verdicts(results(escaped))[1] == [f"hostile fork_bomb: {escaped} m"]
    problems = compose_test.hostile_verdicts(results("memory_exceeded", benign="timeout"))[1]
    assert len(problems) == len(compose_test.HOSTILE) and problems[0].startswith("benign run beside")
