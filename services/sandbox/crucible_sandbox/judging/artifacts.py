"""The compile cache: what a compile step left in `out/`, on disk, by `languages.artifact_key`.

Shared by the slots of a server (a directory of its own under `work_root`, mode 0700): an RL
batch sends many runs of one program (verl sends each stdin case as a request of its own), and
any slot may get them. Not shared by tenants: the key holds the request's `cache_scope`. Written by the trusted worker only, to a temporary name then renamed, so a
reader sees a whole entry or none; runs cannot reach it (outside their root, or outside what
Landlock lets them write). Entries are marshalled `{name: bytes}`; past `entries` files or
`max_bytes` in all (the work root is often a small tmpfs that runs need too) the least recently
used go.
"""

from __future__ import annotations

import contextlib
import marshal
import os

ENTRIES = 512
MAX_BYTES = 256 << 20


class Artifacts:
    def __init__(self, root: str, entries: int = ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.root, self.entries, self.max_bytes = os.path.join(root, "compiled"), entries, max_bytes
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def get(self, key: str) -> dict[str, bytes] | None:
        try:
            with open(self._path(key), "rb") as f:
                files = marshal.load(f)
            os.utime(self._path(key))  # recently used
        except (OSError, EOFError, ValueError, TypeError):
            return None
        if type(files) is not dict:
            return None
        return files

    def put(self, key: str, files: dict[str, bytes]) -> None:
        tmp = f"{self._path(key)}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                marshal.dump(files, f)
            os.replace(tmp, self._path(key))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        self._prune()

    def _prune(self) -> None:
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        aged = []
        for name in names:
            with contextlib.suppress(OSError):
                st = os.stat(self._path(name))
                aged.append((st.st_mtime, st.st_size, name))
        aged.sort()
        total = sum(size for _, size, _ in aged)
        while aged and (len(aged) > self.entries or total > self.max_bytes):
            _, size, name = aged.pop(0)
            total -= size
            with contextlib.suppress(OSError):
                os.unlink(self._path(name))
