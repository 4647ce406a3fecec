"""The README's annotated file tree against the code: every path it names exists (entries, and the
modules its notes list), and every top-level folder and every package is in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_ENTRY = re.compile(r"^(?P<indent>[│ ]*)[├└]── (?P<rest>.*)$")
_MODULE = re.compile(r"(?<![\w/.-])([A-Za-z_][\w-]*\.(?:py|sh))\b")


def tree() -> list[tuple[Path, str]]:
    """(path, note) of every entry of the tree in the README's "Layout" section; a note is the text
    after the name, continuation lines included."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    stack: list[Path] = []  # the folder at each depth
    out: list[tuple[Path, str]] = []
    for line in block.splitlines()[1:]:  # the first line is "."
        m = _ENTRY.match(line)
        if m is None:  # a continuation of the previous entry's note
            if out and line.strip(" │"):
                out[-1] = (out[-1][0], out[-1][1] + " " + line.strip(" │"))
            continue
        depth = len(m["indent"]) // 4
        parts = re.split(r"\s{2,}", m["rest"].strip(), maxsplit=1)
        names, note = parts[0], parts[1] if len(parts) > 1 else ""
        parent = stack[depth - 1] if depth else Path()
        for i, name in enumerate(n.strip() for n in names.split(",")):
            path = parent / name.rstrip("/")
            out.append((path, note if i == 0 else ""))
            if name.endswith("/"):
                del stack[depth:]
                stack.append(path)
    return out


def test_every_path_in_the_tree_exists() -> None:
    entries = tree()
    assert len(entries) > 40  # the parser found the tree
    missing = [str(p) for p, _ in entries if not (ROOT / p).exists()]
    for path, note in entries:
        folder = path if (ROOT / path).is_dir() else path.parent
        for name in _MODULE.findall(note):
            if not (ROOT / folder / name).exists():
                missing.append(f"{folder / name} (named in the note of {path})")
    assert not missing, f"the README's tree names paths that do not exist: {missing}"


def test_every_top_level_folder_and_package_is_in_the_tree() -> None:
    listed = {q for p, _ in tree() for q in (p, *p.parents)}  # `shared/crucible_shared/` lists `shared`
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    top = {Path(f.split("/", 1)[0]) for f in tracked if "/" in f and not f.startswith(".")}
    packages = {p.parent.relative_to(ROOT) for p in ROOT.glob("*/crucible_*/__init__.py")}
    packages |= {p.parent.relative_to(ROOT) for p in ROOT.glob("services/*/crucible_*/__init__.py")}
    unlisted = sorted(str(p) for p in (top | packages) - listed)
    assert packages and not unlisted, f"add these to the README's tree: {unlisted}"
