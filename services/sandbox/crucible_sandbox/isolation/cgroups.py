"""cgroups of a zygote's runs: end every process of a run at once, and hold its memory to the limit.

Each zygote slot gets, in the cgroup v2 hierarchy,

    <v2 mount>/crucible-sandbox/s<server pid>-<slot>/program   the program's process and its children
    <v2 mount>/crucible-sandbox/s<server pid>-<slot>/judge     the run's judge

and `cgroup.kill` on each ends its processes. The run's memory limit is the program
cgroup's `memory.max` when the v2 memory controller can be enabled there; on a host whose memory
controller is mounted as cgroup v1 instead, the slot gets `<v1 memory mount>/<own
cgroup>/crucible-sandbox/s<server pid>-<slot>` and its `memory.limit_in_bytes`. Either way the
limit covers every process of the program together, and the kernel's OOM kill count there tells
the zygote that a run died of it. With neither, `Capabilities.memory` says "sampled" and the
zygote measures the run's processes itself (see `confine`).

The program's process writes its own run's limit (it is still root then) before it drops its
privileges; the zygote never touches the limit. The worker removes a slot's directories once its
zygote has exited, and the server removes the `crucible-sandbox` parents it leaves empty (and
those of servers that died without doing so).
"""

from __future__ import annotations

import contextlib
import os
import time

PARENT = "crucible-sandbox"


def _mounts() -> list[tuple[str, str, list[str]]]:
    try:
        with open("/proc/mounts") as f:
            return [(p[1], p[2], p[3].split(",")) for p in (line.split() for line in f) if len(p) > 3]
    except OSError:
        return []


def v2_root() -> str | None:
    return next((point for point, kind, _ in _mounts() if kind == "cgroup2"), None)


def v1_memory_root() -> str | None:
    """This process's own cgroup in a v1 memory hierarchy, if the host mounts one."""
    point = next((p for p, kind, opts in _mounts() if kind == "cgroup" and "memory" in opts), None)
    if point is None:
        return None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    return os.path.join(point, path.lstrip("/"))
    except (OSError, ValueError):
        pass
    return point


def parents() -> list[str]:
    """Where slots' directories live (that exist)."""
    found = [os.path.join(r, PARENT) for r in (v2_root(), v1_memory_root()) if r]
    return [p for p in found if os.path.isdir(p)]


def _write(path: str, data: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(data)
        return True
    except OSError:
        return False


def _open(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CLOEXEC)


class SlotCgroups:
    """A zygote's cgroups, their control files opened once (a run costs writes, not opens)."""

    def __init__(self, owner: int, slot: int) -> None:
        self.paths: list[str] = []  # created here, deepest last (the worker removes them)
        self.memory: str | None = None  # "cgroup v2", "cgroup v1" or None
        self.notes: list[str] = []
        # [program, judge]: each is killed on its own (a judge forked ahead outlives a run without one).
        self.kill_fds, self.events_fds, self.procs_fds = [-1, -1], [-1, -1], [-1, -1]
        self.v1_procs_fd = -1
        self.limit_fd = -1
        self.oom_file: str | None = None  # where the kernel counts this slot's OOM kills
        name = f"s{owner}-{slot}"
        root = v2_root()
        if root is not None:
            self._make_v2(root, name)
        if self.usable and self.memory is None:
            self._make_v1_memory(name)

    @property
    def usable(self) -> bool:
        return self.kill_fds[0] >= 0

    def _make_v2(self, root: str, name: str) -> None:
        parent = os.path.join(root, PARENT)
        slot = os.path.join(parent, name)
        for _ in range(3):  # another server may remove an empty parent at the same moment
            try:
                os.makedirs(slot, exist_ok=True)
                break
            except FileNotFoundError:
                continue
            except OSError as e:
                self.notes.append(f"no cgroup ({e.strerror})")
                return
        if not os.path.exists(os.path.join(slot, "cgroup.kill")):
            with contextlib.suppress(OSError):
                os.rmdir(slot)
            self.notes.append("no cgroup.kill (kernel older than 5.14)")
            return
        # The memory controller must be enabled on every level above the program's cgroup.
        memory = all(
            "memory" in _read(os.path.join(d, "cgroup.controllers")).split()
            or _write(os.path.join(os.path.dirname(d), "cgroup.subtree_control"), "+memory")
            for d in (parent, slot)
        )
        memory = memory and _write(os.path.join(slot, "cgroup.subtree_control"), "+memory")
        dirs = [os.path.join(slot, "program"), os.path.join(slot, "judge")]
        try:
            for d in dirs:
                os.makedirs(d, exist_ok=True)
            self.paths += [slot, *dirs]
            for i, d in enumerate(dirs):
                self.kill_fds[i] = _open(os.path.join(d, "cgroup.kill"), os.O_WRONLY)
                self.events_fds[i] = _open(os.path.join(d, "cgroup.events"), os.O_RDONLY)
                self.procs_fds[i] = _open(os.path.join(d, "cgroup.procs"), os.O_WRONLY)
            if memory and os.path.exists(os.path.join(dirs[0], "memory.max")):
                _write(os.path.join(dirs[0], "memory.swap.max"), "0")
                self.limit_fd = _open(os.path.join(dirs[0], "memory.max"), os.O_RDWR)
                self.oom_file = os.path.join(dirs[0], "memory.events")
                self.memory = "cgroup v2"
        except OSError as e:
            self.notes.append(f"no cgroup ({e.strerror})")
            self.close()

    def _make_v1_memory(self, name: str) -> None:
        root = v1_memory_root()
        if root is None:
            return
        path = os.path.join(root, PARENT, name)
        try:
            os.makedirs(path, exist_ok=True)
            self.paths.append(path)
            self.v1_procs_fd = _open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
            _write(os.path.join(path, "memory.swappiness"), "0")
            self.limit_fd = _open(os.path.join(path, "memory.limit_in_bytes"), os.O_RDWR)
            self.oom_file = os.path.join(path, "memory.oom_control")
            self.memory = "cgroup v1"
        except OSError as e:
            self.notes.append(f"no v1 memory cgroup ({e.strerror})")

    # -- per run ------------------------------------------------------------------------------
    def join_program(self) -> None:
        """Move the calling process (a run's program, before it runs anything) into its cgroups."""
        for fd in (self.procs_fds[0], self.v1_procs_fd):
            if fd >= 0:
                os.write(fd, b"0")

    def join_judge(self) -> None:
        if self.procs_fds[1] >= 0:
            os.write(self.procs_fds[1], b"0")

    def set_memory(self, mb: int) -> None:
        """The program's memory limit for its run (written by the program's process, still root).

        Read first: most runs ask for the last run's limit, and a write costs the kernel more.
        """
        if self.limit_fd >= 0:
            limit = str(mb << 20).encode()
            with contextlib.suppress(OSError):  # v1 refuses a limit under current use: the last stays
                if os.pread(self.limit_fd, 32, 0).strip() != limit:
                    os.pwrite(self.limit_fd, limit, 0)

    def populated(self, judge: bool) -> bool:
        """Whether a process is left in the program's cgroup (and the judge's, when it ran)."""
        fds = self.events_fds if judge else self.events_fds[:1]
        return any(fd >= 0 and b"populated 1" in os.pread(fd, 128, 0) for fd in fds)

    def kill_all(self, judge: bool) -> None:
        for fd in self.kill_fds if judge else self.kill_fds[:1]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.write(fd, b"1")

    def child_fds(self) -> set[int]:
        """Descriptors a program process keeps until it has set its limit."""
        return {self.limit_fd} if self.limit_fd >= 0 else set()

    def close(self) -> None:
        for fd in (
            *self.kill_fds,
            *self.events_fds,
            *self.procs_fds,
            self.v1_procs_fd,
            self.limit_fd,
        ):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.kill_fds, self.events_fds, self.procs_fds = [-1, -1], [-1, -1], [-1, -1]
        self.v1_procs_fd = self.limit_fd = -1


class OomCounter:
    """The kernel's count of processes killed for a slot's memory limit (read by the worker).

    Read after every run, whether or not its program finished: a run whose child was killed for
    memory exceeded its limit even if the program carried on.
    """

    def __init__(self, path: str) -> None:
        self.fd = _open(path, os.O_RDONLY)
        self.seen = self._count()

    def _count(self) -> int:
        try:
            for line in os.pread(self.fd, 4096, 0).decode().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def grew(self) -> bool:
        seen, self.seen = self.seen, self._count()
        return self.seen > seen


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def remove(paths: list[str]) -> None:
    """Remove a slot's cgroups (deepest first), killing what is left in them first."""
    for path in sorted(paths, key=len, reverse=True):
        _write(os.path.join(path, "cgroup.kill"), "1")
        for _ in range(50):  # a killed cgroup empties asynchronously
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


def remove_stale() -> None:
    """Remove slots' cgroups of sandbox servers that are no longer running."""
    for parent in parents():
        for name in os.listdir(parent):
            owner = name[1:].partition("-")[0] if name.startswith("s") else ""
            if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                slot = os.path.join(parent, name)
                remove(
                    [
                        os.path.join(slot, sub)
                        for sub in ("program", "judge")
                        if os.path.isdir(os.path.join(slot, sub))
                    ]
                    + [slot]
                )


def remove_empty_parents() -> None:
    for parent in parents():
        with contextlib.suppress(OSError):  # still holds another server's slots
            os.rmdir(parent)
