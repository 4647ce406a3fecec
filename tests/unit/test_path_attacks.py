"""Every place a job's text becomes a file-system path, attacked one class at a time: absolute
paths, encoded separators, `..`, symbolic links out of the roots, `/proc/self/environ`, NUL.

Surfaces: a job spec's paths as the worker checks and then reads them (`PathRoots`,
`with_checked_paths`), the same at submission (`check_present`), pipeline `reuse` (`link_tree`)
and the sandbox's scratch clean-up (`remove_tree`). The generator's `lora_path` is attacked over
HTTP in tests/integration/test_generator_adapter_roots.py, the gateway's artifacts route in
tests/integration/test_gateway_hardening.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from crucible_shared.jobs import EvalJob, PipelineJob, TrainJob
from crucible_shared.paths import PathOutsideRoots, PathRoots

SECRET = "s3cret-do-not-read"


@pytest.fixture
def world(tmp_path: Path, monkeypatch) -> dict[str, Path]:
    """Roots under `tmp_path/roots`, a secret beside them, the worker running inside the data root
    (the default: roots default to the working directory)."""
    roots = tmp_path / "roots"
    for kind in ("data", "models", "adapters"):
        (roots / kind).mkdir(parents=True)
    outside = tmp_path / "outside"
    (outside / "a" / "b").mkdir(parents=True)
    (outside / "a" / "x.jsonl").write_text(SECRET)
    (outside / "secret.jsonl").write_text(SECRET)
    (roots / "data" / "ok.jsonl").write_text("{}\n")
    monkeypatch.setenv("CRUCIBLE_DATA_ROOTS", str(roots / "data"))
    monkeypatch.setenv("CRUCIBLE_MODEL_ROOTS", str(roots / "models"))
    monkeypatch.setenv("CRUCIBLE_ADAPTER_ROOTS", str(roots / "adapters"))
    monkeypatch.chdir(roots / "data")
    return {
        "data": roots / "data",
        "models": roots / "models",
        "adapters": roots / "adapters",
        "outside": outside,
    }


def train(path: str) -> TrainJob:
    return TrainJob.model_validate({"data": {"dataset": "jsonl", "path": path}})


# Each path is refused by the worker's check (links resolved) with the field named.
REFUSED = {
    "absolute": "/etc/passwd",
    "absolute, double slash": "//etc/passwd",
    "dot-dot": "../../../../../../etc/passwd",
    "dot-dot inside then out": "sub/../../outside/secret.jsonl",
    "proc": "/proc/self/environ",
    "home": "~/.ssh/id_rsa",
    "NUL": "ok.jsonl\x00/../../etc/passwd",
}


@pytest.mark.parametrize("attack", sorted(REFUSED))
def test_a_data_path_out_of_the_roots_is_refused(world, attack: str) -> None:
    if attack == "home" and str(Path.home()).startswith(str(world["data"])):
        pytest.skip("home lies inside the data root here")
    with pytest.raises(PathOutsideRoots, match=r"data\.path"):
        PathRoots().check(train(REFUSED[attack]), real=True)


def test_an_encoded_separator_is_a_name_not_a_separator(world) -> None:
    # `%2F` is not decoded anywhere: it names a file of that name under the root, nothing else.
    (path,) = PathRoots().check(train("..%2F..%2Foutside%2Fsecret.jsonl"), real=True).values()
    assert path == world["data"] / "..%2F..%2Foutside%2Fsecret.jsonl"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (TrainJob.model_validate({"model": {"base": "org/../../../../etc"}}), "model.base"),
        (TrainJob.model_validate({"model": {"base": "a/b/../../../../../etc"}}), "model.base"),
        (EvalJob.model_validate({"model": {"base": "x/../../../root"}}), "model.base"),
        (PipelineJob.model_validate({"model": {"base": "org/../../../../tmp"}}), "model.base"),
    ],
)
def test_a_model_name_with_dot_dot_is_a_path_and_checked(world, spec, field: str) -> None:
    """Before, `org/../../etc` passed as a hub id and a loader took it as a directory relative to
    the worker's working directory, outside every root."""
    with pytest.raises(PathOutsideRoots, match=field.replace(".", r"\.")):
        PathRoots().check(spec)


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("data.path", lambda p: train(p)),
        (
            "eval.data.path",
            lambda p: TrainJob.model_validate({"eval": {"data": {"dataset": "jsonl", "path": p}}}),
        ),
        (
            "method.path",
            lambda p: TrainJob.model_validate({"method": {"name": "sft", "path": p}, "optim": {"lr": 1e-4}}),
        ),
        ("data.path", lambda p: EvalJob.model_validate({"data": {"dataset": "jsonl", "path": p}})),
    ],
)
def test_a_link_out_of_the_roots_is_refused_by_name(world, field: str, make) -> None:
    (world["data"] / "dir").symlink_to(world["outside"], target_is_directory=True)
    (world["data"] / "file.jsonl").symlink_to(world["outside"] / "secret.jsonl")
    (world["data"] / "environ").symlink_to("/proc/self/environ")
    for value, link in (
        ("dir/secret.jsonl", "dir"),
        ("file.jsonl", "file.jsonl"),
        ("environ", "environ"),
        (str(world["data"] / "dir" / "a" / "x.jsonl"), "dir"),
    ):
        spec = make(value)
        assert PathRoots().check(spec)[field]  # lexically inside: only the real check can see it
        with pytest.raises(PathOutsideRoots, match="symbolic link") as caught:
            PathRoots().check(spec, real=True)
        assert caught.value.field == field and str(world["data"] / link) in caught.value.message


def test_adapter_links_out_are_refused_by_name(world) -> None:
    (world["adapters"] / "v1").symlink_to(world["outside"], target_is_directory=True)
    for spec, field in (
        (EvalJob.model_validate({"adapter": "v1"}), "adapter"),
        (
            TrainJob.model_validate({"model": {"init_adapter": str(world["adapters"] / "v1")}}),
            "model.init_adapter",
        ),
    ):
        with pytest.raises(PathOutsideRoots, match=f"{world['adapters'] / 'v1'} is a symbolic link"):
            PathRoots().check(spec, real=True)
        assert field in PathRoots().check(spec)


def test_the_worker_reads_the_path_it_checked_not_the_raw_text(world) -> None:
    """`link/../x.jsonl` is `root/x.jsonl` to a lexical check, but the kernel walks the link first:
    `outside/a/b/../x.jsonl`. The old worker checked the first and read the second (the spec's raw
    text, relative to its working directory). Now it reads the normalised path it checked."""
    from crucible_shared.paths import with_checked_paths

    (world["data"] / "link").symlink_to(world["outside"] / "a" / "b", target_is_directory=True)
    spec = train("link/../x.jsonl")
    assert Path(spec.data.path).read_text() == SECRET  # what reading the raw text gives
    paths = PathRoots().check(spec, real=True)
    read = with_checked_paths(spec, PathRoots().check(spec)).data.path
    assert read == str(world["data"] / "x.jsonl") == str(paths["data.path"])
    assert not Path(read).exists()


def test_a_relative_path_is_read_under_the_root_it_was_checked_under(world, tmp_path, monkeypatch) -> None:
    from crucible_shared.paths import with_checked_paths

    elsewhere = tmp_path / "worker-cwd"
    elsewhere.mkdir()
    (elsewhere / "keys.jsonl").write_text(SECRET)
    monkeypatch.chdir(elsewhere)  # the worker's working directory is not the data root
    spec = train("keys.jsonl")
    PathRoots().check(spec, real=True)  # passes: data-root/keys.jsonl
    assert with_checked_paths(spec, PathRoots().check(spec)).data.path == str(world["data"] / "keys.jsonl")


# -- at submission ---------------------------------------------------------------------------------


def test_submission_checks_files_on_roots_it_sees(world) -> None:
    from crucible_shared.paths import PathMissing

    roots = PathRoots()
    assert roots.check_present(train("ok.jsonl")) == {"data.path": world["data"] / "ok.jsonl"}
    with pytest.raises(PathMissing, match="does not exist"):
        roots.check_present(train("missing.jsonl"))
    with pytest.raises(PathMissing, match="is a directory"):
        roots.check_present(train(str(world["data"])))
    (world["data"] / "out.jsonl").symlink_to(world["outside"] / "secret.jsonl")
    with pytest.raises(PathOutsideRoots, match=f"{world['data'] / 'out.jsonl'} is a symbolic link"):
        roots.check_present(train("out.jsonl"))
    with pytest.raises(PathMissing, match="no PEFT adapter") as caught:
        roots.check_present(EvalJob.model_validate({"adapter": "nope/v3"}))
    assert caught.value.field == "adapter"
    (world["adapters"] / "v1").mkdir()
    (world["adapters"] / "v1" / "adapter_config.json").write_text("{}")
    assert (
        roots.check_present(EvalJob.model_validate({"adapter": "v1"}))["adapter"] == world["adapters"] / "v1"
    )


def test_submission_leaves_roots_it_cannot_see_to_the_worker(world, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CRUCIBLE_DATA_ROOTS", str(tmp_path / "not-mounted-here"))
    assert PathRoots().check_present(train("later.jsonl"))  # the worker checks it again
    with pytest.raises(PathOutsideRoots):
        PathRoots().check_present(train("/etc/passwd"))  # the lexical check still applies


# -- pipeline `reuse` ---------------------------------------------------------------------------------


def test_reuse_does_not_copy_what_links_in_a_run_dir_point_at(tmp_path: Path) -> None:
    from crucible_trainer.offline.artifacts import link_tree

    source, target, outside = tmp_path / "runs" / "old", tmp_path / "runs" / "new", tmp_path / "outside"
    (source / "round-1").mkdir(parents=True)
    outside.mkdir()
    (outside / "shadow").write_text(SECRET)
    (source / "round-1" / "nbest.jsonl").write_text("{}\n")
    (source / "round-1" / "shadow").symlink_to(outside / "shadow")
    (source / "round-1" / "etc").symlink_to(outside, target_is_directory=True)
    (source / "eval").symlink_to(outside, target_is_directory=True)
    (source / "pipeline.json").symlink_to(outside / "shadow")
    copied = link_tree(source, target, ["eval", "round-1", "pipeline.json"])
    assert copied == ["round-1"]
    found = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    assert found == ["round-1", "round-1/nbest.jsonl"], found


# -- the sandbox's scratch -------------------------------------------------------------------------


def test_scratch_clean_up_never_follows_a_link_a_run_left(tmp_path: Path) -> None:
    """A run may leave links to anything in its scratch; removing the scratch removes the links,
    never what they point at (already so: `remove_tree` opens with O_NOFOLLOW)."""
    from crucible_sandbox.isolation.confine import remove_tree

    scratch, keep = tmp_path / "run-1", tmp_path / "host"
    (keep / "dir").mkdir(parents=True)
    (keep / "dir" / "precious").write_text(SECRET)
    (scratch / "sub").mkdir(parents=True)
    (scratch / "sub" / "to-dir").symlink_to(keep / "dir", target_is_directory=True)
    (scratch / "to-file").symlink_to(keep / "dir" / "precious")
    (scratch / "to-host").symlink_to(keep, target_is_directory=True)
    (scratch / "proc").symlink_to("/proc/self", target_is_directory=True)
    remove_tree(str(scratch))
    assert not scratch.exists()
    assert (keep / "dir" / "precious").read_text() == SECRET


def test_the_run_dir_itself_as_a_link_is_not_followed(tmp_path: Path) -> None:
    from crucible_sandbox.isolation.confine import remove_tree

    keep = tmp_path / "host"
    keep.mkdir()
    (keep / "precious").write_text(SECRET)
    os.symlink(keep, tmp_path / "run-2")
    remove_tree(str(tmp_path / "run-2"))
    assert (keep / "precious").read_text() == SECRET
