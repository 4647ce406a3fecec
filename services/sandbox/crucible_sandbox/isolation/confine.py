"""A slot's isolation: set up once in its zygote (`setup_zygote`), entered by each of a run's
processes before its spec is read (`Isolation.enter_program`, `enter_judge`), tightened once it is
read (`confine_program`, `confine_judge`: memory limit, uid, rlimits) and torn down after the run
(`end_run`). What it covers, and what not: the package's docstring.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
import time
from typing import TYPE_CHECKING, Literal, cast

from crucible_sandbox.inrun import runtime
from crucible_sandbox.isolation import cgroups, landlock, rootfs

if TYPE_CHECKING:
    from crucible_sandbox.wire.messages import CapabilitiesData, RunLimits

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC = 0x00020000, 0x40000000, 0x08000000
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
JUDGE_UIDS = 32768  # the judge of slot i runs as uid_base + JUDGE_UIDS + i
JUDGE_MEMORY_MB = 2048
SAMPLE_S = 0.02
SCRATCH_SAMPLE_S = 0.005  # the scratch walk's interval where no tmpfs bounds it (Landlock mode)
SCRATCH_ENTRIES = 4096  # as the full mode's scratch tmpfs (`rootfs.scratch_options`: nr_inodes)
# What a run may write to files in all, in scratch sizes, where its scratch is sampled: a bound no
# sample can miss (a writer can fill and free its files between two samples of a starved zygote).
WRITTEN_SCRATCHES = 2


def _load_libc() -> ctypes.CDLL:
    # `ctypes.util` imports subprocess, threading and random; forked runs would then pay for
    # their at-fork hooks, so it is only the fallback for a libc with another name.
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        from ctypes.util import find_library

        return ctypes.CDLL(find_library("c"), use_errno=True)


_libc = _load_libc()
_libc.syscall.restype = ctypes.c_long

SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
_PAGE = os.sysconf("SC_PAGE_SIZE")


def undumpable() -> None:
    """No process of this uid may read this process's memory or /proc files (environ)."""
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# Plain classes rather than dataclasses: `dataclasses` imports `inspect`, about 1.5 MB of the
# zygote's heap, and every fork copies the page tables of all of it.
class Capabilities:
    """What this zygote could set up; reported by `GET /health` (see `report`)."""

    def __init__(self) -> None:
        self.network_namespace = False
        self.mount_namespace = False
        self.filesystem = "host"  # "minimal root" | "landlock" | "host"
        self.uid_switch = False
        self.ipc_namespace = False
        self.cgroup: str | None = None
        self.memory = "sampled"  # "cgroup v2" | "cgroup v1" | "sampled"
        self.subreaper = False
        self.masked: list[str] = []
        self.notes: list[str] = []

    @property
    def mode(self) -> Literal["full", "reduced"]:
        full = self.network_namespace and self.filesystem == "minimal root" and self.uid_switch
        return "full" if full else "reduced"

    def report(self) -> CapabilitiesData:
        """Every attribute, for the worker and `GET /health`."""
        return cast("CapabilitiesData", dict(vars(self)))


class IsolationConfig:
    """How a slot's zygote isolates its runs (sent by the worker as JSON)."""

    def __init__(
        self,
        slot: int,
        owner: int = 0,
        uid_base: int = 61000,
        tmpfs_mb: int = 64,
        work_root: str = "/tmp/crucible-sandbox",
        want_namespaces: bool = True,
        want_cgroup: bool = True,
        want_mount_namespace: bool = True,
        want_memory_cgroup: bool = True,
    ) -> None:
        self.slot, self.owner = slot, owner or os.getppid()
        self.uid_base, self.tmpfs_mb, self.work_root = uid_base, tmpfs_mb, work_root
        self.want_namespaces, self.want_cgroup = want_namespaces, want_cgroup
        self.want_mount_namespace, self.want_memory_cgroup = want_mount_namespace, want_memory_cgroup


class Isolation:
    """What `setup_zygote` set up, and the per-run steps that use it.

    A run costs the zygote a fork or two and a few syscalls here: the cgroup files are opened once,
    and scratch directories are only listed when their tmpfs has an inode in use.
    """

    def __init__(
        self,
        cfg: IsolationConfig,
        caps: Capabilities,
        cgroup: cgroups.SlotCgroups | None,
        ruleset: landlock.Ruleset | None,
        slot_dir: str | None,
    ) -> None:
        self.cfg, self.caps, self.cgroup, self.ruleset, self.slot_dir = cfg, caps, cgroup, ruleset, slot_dir
        self.uid = cfg.uid_base + cfg.slot
        self.judge_uid = cfg.uid_base + JUDGE_UIDS + cfg.slot
        # Free inodes of each scratch tmpfs, freshly mounted and so empty: any other count means
        # a run left something behind (a count cannot be faked the way a timestamp can).
        self.scratch_free = (
            {d: os.statvfs(d).f_ffree for d in rootfs.SCRATCH if os.path.isdir(d)}
            if caps.filesystem == "minimal root"
            else {}
        )
        # A run's directory on the work root's file system (no scratch tmpfs of its own): nothing
        # bounds what it writes there but the zygote's sampling (`scratch_over`).
        self.sampled_scratch = caps.filesystem != "minimal root" and slot_dir is not None

    def workdir(self, pid: int) -> str:
        """The run's working directory: the private /tmp, or a fresh directory in the slot's."""
        if self.caps.filesystem == "minimal root" or self.slot_dir is None:
            return "/tmp"
        return os.path.join(self.slot_dir, f"run-{pid}")

    def keep_fds(self) -> set[int]:
        """Descriptors a freshly forked program process keeps until `confine_program`."""
        return self.cgroup.child_fds() if self.cgroup is not None and self.caps.memory != "sampled" else set()

    # -- in a freshly forked process, still privileged: bare syscalls (every page of the zygote
    # this touches is copied for the run) ----------------------------------------------------------
    def _enter(self) -> None:
        os.setsid()
        _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)

    def enter_program(self) -> None:
        """Called in a freshly forked program process, before its spec is read."""
        self._enter()
        if self.cgroup is not None:
            with contextlib.suppress(OSError):  # still killed through its group and the subreaper
                self.cgroup.join_program()
        workdir = self.workdir(os.getpid())
        if workdir != "/tmp":
            os.makedirs(workdir, mode=0o700)
            os.environ["TMPDIR"] = os.environ["HOME"] = workdir
            if self.caps.uid_switch:
                os.chown(workdir, self.uid, self.uid)
        os.chdir(workdir)
        os.umask(0o077)
        if self.ruleset is not None:
            self.ruleset.restrict()
            if workdir != "/tmp":
                self.ruleset.restrict_writes(workdir)

    def enter_judge(self) -> None:
        """Called in a freshly forked judge process, before its spec is read."""
        self._enter()
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.join_judge()
        os.chdir("/")
        if self.ruleset is not None:
            self.ruleset.restrict()
            self.ruleset.restrict_writes(None)  # the judge writes no file

    # -- in the run's processes, once their spec is read --------------------------------------
    def confine_program(self, limits: RunLimits) -> None:
        """The run's memory limit (for all its processes), then the slot's uid."""
        if not self.caps.uid_switch:
            # RLIMIT_NPROC counts every process of the uid on the host: without a uid of its own a
            # run would be counted with the service's threads (and the container's other
            # services') and could not even fork. The container's pids limit bounds it instead.
            limits.pop("processes", None)
        if self.cgroup is not None and self.caps.memory != "sampled":
            self.cgroup.set_memory(int(limits["memory_mb"]))
        for fd in self.keep_fds():
            os.close(fd)
        self._drop(self.uid)

    def confine_judge(self, limits: RunLimits) -> None:
        self._drop(self.judge_uid)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # not even its own uid may read its memory
        runtime.apply_limits(limits, processes=1, memory_mb=max(JUDGE_MEMORY_MB, int(limits["memory_mb"])))

    def _drop(self, uid: int) -> None:
        if self.caps.uid_switch:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    # -- in the zygote --------------------------------------------------------------------------
    def memory_used(self, program: int, exclude: set[int | None]) -> int:
        """Resident bytes of the run's program and everything it started (the sampled fallback)."""
        total = 0
        for pid in _run_processes(program, exclude):
            try:
                with open(f"/proc/{pid}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * _PAGE
            except (OSError, ValueError, IndexError):
                continue
        return total

    def _held_unlinked(self, program: int, exclude: set[int | None], device: int) -> int:
        """Bytes of files on the run directory's file system that the run's processes hold open
        but that have no name any more (written, then unlinked): no walk of the tree sees them."""
        total, seen = 0, set()
        for pid in _run_processes(program, exclude):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if st.st_dev == device and st.st_nlink == 0 and st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
        return total

    def written(self) -> int | None:
        """Bytes this zygote and the processes it has reaped wrote to files (the kernel's
        `write_bytes`, counted as page-cache pages are dirtied; a reaped child's count includes
        its own reaped children's). None where scratch is not sampled or the kernel keeps no count."""
        if not self.sampled_scratch:
            return None
        try:
            with open("/proc/self/io", "rb") as f:
                return int(f.read().split(b"write_bytes:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            return None

    def wrote_past_scratch(self, before: int | None) -> bool:
        """Whether the run reaped since `written()` returned `before` wrote more to files than
        `WRITTEN_SCRATCHES` scratches, in all: files it unlinked while holding them, and freed
        before a sample, count too."""
        if before is None:
            return False
        after = self.written()
        return after is not None and after - before > WRITTEN_SCRATCHES * self.cfg.tmpfs_mb << 20

    def scratch_over(self, program: int, exclude: set[int | None]) -> bool:
        """Whether the run's directory holds more than the full mode's scratch may: `tmpfs_mb` MiB
        or `SCRATCH_ENTRIES` entries (the sampled fallback where it is not a tmpfs of its own).

        Walks by descriptor (a run may nest directories thousands of levels down, past what a
        path can name), following no link, and stops at the first limit passed; files the run's
        processes hold open after unlinking them count too.
        """
        most, left = self.cfg.tmpfs_mb << 20, SCRATCH_ENTRIES
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        # The open directories down to the one being walked, each with its subdirectories left
        # to visit (None: not listed yet).
        stack: list[tuple[int, list[str] | None]] = []
        try:
            stack.append((os.open(self.workdir(program), flags), None))
            used = self._held_unlinked(program, exclude, os.fstat(stack[0][0]).st_dev)
            if used > most:
                return True
            while stack:
                fd, names = stack[-1]
                if names is None:
                    names = []
                    with os.scandir(fd) as entries:
                        for entry in entries:
                            left -= 1
                            used += entry.stat(follow_symlinks=False).st_blocks * 512
                            if left < 0 or used > most:
                                return True
                            if entry.is_dir(follow_symlinks=False):
                                names.append(entry.name)
                    stack[-1] = (fd, names)
                if names:
                    stack.append((os.open(names.pop(), flags, dir_fd=fd), None))
                else:
                    os.close(stack.pop()[0])
        except OSError:  # changed meanwhile: counted at the next sample
            pass
        finally:
            for fd, _ in stack:
                os.close(fd)
        return False

    def end_run(self, pgids: list[int], workdir_pid: int, spare: int | None) -> int:
        """After the run's processes were reaped: kill what they left behind and empty their scratch.

        `spare`: a judge forked ahead that the run did not use. Returns how many stray processes
        had to be killed.
        """
        strays = 0
        judged = spare is None
        # As a subreaper the zygote inherits every orphaned descendant, and the cgroups hold
        # every process a run started; with neither showing one, nothing is left to kill.
        if (
            not self.caps.subreaper
            or [p for p in _children() if p != spare]
            or (self.cgroup is not None and self.cgroup.populated(judged))
        ):
            strays = kill_everything(pgids, self.cgroup, judged, spare)
        if self.scratch_free:
            rootfs.reset_scratch(_libc, self.scratch_free, self.cfg.tmpfs_mb)
        elif self.workdir(workdir_pid) != "/tmp":
            remove_tree(self.workdir(workdir_pid))
        return strays

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.close()
        if self.ruleset is not None:
            self.ruleset.close()


def setup_zygote(cfg: IsolationConfig) -> Isolation:
    """Run once in the zygote before it forks any run."""
    caps = Capabilities()
    caps.subreaper = _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    # Inherited by every run it forks (the zygote itself never execs; runs may, without gaining
    # privileges from setuid binaries or file capabilities). Landlock needs it too.
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    root = os.geteuid() == 0
    # Made before the new root hides /sys.
    cgroup = cgroups.SlotCgroups(cfg.owner, cfg.slot) if cfg.want_cgroup and root else None
    if cgroup is not None:
        caps.notes += cgroup.notes
        if not cgroup.usable:
            cgroup.close()
            cgroup = None
    if cgroup is not None:
        caps.cgroup = cgroup.paths[0]
        if cfg.want_memory_cgroup and cgroup.memory:
            caps.memory = cgroup.memory
    if cfg.want_namespaces and root:
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            caps.network_namespace = True
        except OSError as e:
            caps.notes.append(f"no network namespace ({e.strerror})")
        if cfg.want_mount_namespace:
            _enter_mount_namespace(cfg, caps)
        caps.ipc_namespace = _enter_ipc_namespace(caps)
        caps.uid_switch = True
    elif not root:
        caps.notes.append("not root: no namespaces and no uid switch; rely on the container")
    ruleset, slot_dir = None, None
    if caps.filesystem != "minimal root":
        slot_dir = os.path.join(cfg.work_root, f"s{cfg.owner}-{cfg.slot}")
        os.makedirs(slot_dir, mode=0o711, exist_ok=True)
        # `scratch_over` holds a descriptor per level of a run's directory tree.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = SCRATCH_ENTRIES + 64 if hard == resource.RLIM_INFINITY else min(hard, SCRATCH_ENTRIES + 64)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        if cfg.want_namespaces:
            ruleset = landlock.Ruleset.build(_libc, slot_dir)
            if ruleset is not None:
                caps.filesystem = "landlock"
                caps.masked = rootfs.masked(rootfs._exposed())
            else:
                caps.notes.append("no Landlock in this kernel: runs see the host's files")
        if caps.uid_switch and _hidden_ancestor(os.path.realpath(sys.base_prefix)):
            caps.notes.append(
                "the interpreter lies under a directory the run uid cannot enter: without a mount "
                "namespace, runs import only the modules the zygote preloaded"
            )
    # Runs inherit this environment (set once here rather than rewritten in every run).
    os.environ.clear()
    os.environ.update(SAFE_ENV)
    return Isolation(cfg, caps, cgroup, ruleset, slot_dir)


# In the zygote's own IPC namespace: no System V object may outlive the processes that use it.
# (Once per zygote: a namespace per run costs about half a millisecond of CPU to make and tear down.)
_IPC_SYSCTLS = {
    "/proc/sys/kernel/shm_rmid_forced": "1",
    "/proc/sys/kernel/msgmni": "0",
    "/proc/sys/fs/mqueue/queues_max": "0",
}


def _enter_ipc_namespace(caps: Capabilities) -> bool:
    try:
        _check(_libc.unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
        for path, value in _IPC_SYSCTLS.items():
            with open(path, "w") as f:
                f.write(value)
        with open("/proc/sys/kernel/sem") as f:
            semmsl, semmns, semopm, _ = f.read().split()
        with open("/proc/sys/kernel/sem", "w") as f:
            f.write(f"{semmsl} {semmns} {semopm} 0")  # no semaphore sets
    except (OSError, ValueError) as e:
        caps.notes.append(f"no private IPC namespace ({e})")
        return False
    return True


def _enter_mount_namespace(cfg: IsolationConfig, caps: Capabilities) -> None:
    try:
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    except OSError as e:
        caps.notes.append(f"no private mount namespace ({e.strerror})")
        return
    caps.mount_namespace = True
    try:
        caps.masked = rootfs.RootBuilder(_libc, cfg.tmpfs_mb).build()
        caps.filesystem = "minimal root"
    except OSError as e:
        caps.notes.append(f"no root of its own ({e}); falling back to Landlock")
        _libc.umount2(b"/tmp", 2)  # whatever was built on top of /tmp


def remove_tree(path: str) -> None:
    """Delete a directory tree however deep (a run may nest directories thousands of levels down).

    No recursion and at most two directories open: the subdirectories of each directory removed
    are first moved up to the top, so the tree never gets deeper than two levels here.
    """
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    moved = 0
    try:
        for _ in range(1 << 20):  # each pass removes at least one level of every subtree
            names = os.listdir(top)
            if not names:
                break
            for name in names:
                try:
                    child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=top)  # a file, or a link
                    continue
                try:
                    for sub in os.listdir(child):
                        try:
                            os.unlink(sub, dir_fd=child)
                        except OSError:  # a directory: up to the top, removed on a later pass
                            moved += 1
                            with contextlib.suppress(OSError):
                                os.rename(sub, f".crucible-{moved}", src_dir_fd=child, dst_dir_fd=top)
                finally:
                    os.close(child)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _hidden_ancestor(path: str) -> bool:
    """Whether a directory on the way to `path` is closed to other users (e.g. a 0700 /root)."""
    parts = path.strip("/").split("/")
    try:
        return any(not os.stat("/" + "/".join(parts[:i])).st_mode & 0o001 for i in range(1, len(parts) + 1))
    except OSError:
        return True


def _run_processes(program: int, exclude: set[int | None]) -> list[int]:
    """The run's program and every process it started (the zygote's other children, orphans it
    inherited as a subreaper, and their descendants), but those in `exclude`."""
    todo = [program, *(p for p in _children() if p not in exclude and p != program)]
    out, seen = [], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        try:
            with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
                todo += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def _children() -> list[int]:
    """PIDs of this (single-threaded) process's children, zombies included."""
    try:
        fd = os.open("/proc/thread-self/children", os.O_RDONLY)
    except OSError:
        return []
    try:
        return [int(p) for p in os.read(fd, 1 << 16).split()]
    finally:
        os.close(fd)


def kill_everything(
    pgids: list[int], cgroup: cgroups.SlotCgroups | None = None, judged: bool = True, spare: int | None = None
) -> int:
    """Kill a finished run's process groups, its cgroups and every re-parented descendant.

    `spare` (a process forked ahead for a later run) is left alone. Returns how many stray
    processes had to be killed after the run's own processes exited.
    """
    for pgid in pgids:
        with contextlib.suppress(OSError):
            os.killpg(pgid, 9)
    if cgroup is not None:
        cgroup.kill_all(judged)
    strays = 0
    for _ in range(200):
        live = [p for p in _children() if p != spare]
        if not live:
            break
        for pid in live:
            strays += 1
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        for pid in live:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        time.sleep(0.001)
    return strays
