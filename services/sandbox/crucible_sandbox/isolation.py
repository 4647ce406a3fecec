"""Isolation of one run's process: what the sandbox isolates, and what it does not.

Every run is a process forked from a small zygote (never from the HTTP server). Per run:

* **Process tree**: new session and process group; the zygote is a *child subreaper*, so
  descendants that daemonise (double fork + `setsid`) are re-parented to it and killed after
  the run; with cgroup v2 each zygote also has its own cgroup and kills it whole
  (`cgroup.kill`). A parent-death signal kills a run whose zygote dies.
* **Resources** (rlimits): CPU seconds, address space, file size, open files, processes
  (per-slot uid, see below), no core dumps; a wall-clock backstop in the zygote; output read
  concurrently and capped.
* **Filesystem**: each zygote has a private mount namespace with size-limited tmpfs on
  `/tmp` (the working directory), `/var/tmp` and `/dev/shm`; the zygote empties them after
  every run, once the run's processes are dead, so nothing a run writes is seen by the next
  one and disk fill is bounded. The rest of the filesystem is the host's (read-only to the
  run uid where permissions say so).
* **Identity**: when the service runs as root, each zygote slot runs its programs as its own
  unprivileged uid/gid (no supplementary groups, `no_new_privs`), so a program cannot signal
  the server, the zygote or other runs, nor read `/proc/<server>/environ`.
  A run's process is forked ahead of its run and takes that uid as soon as its spec is read,
  before any of it runs.
* **Network**: the zygote unshares a network namespace at start: runs see only a down
  loopback interface.
* **Environment**: scrubbed to `PATH`, `HOME`, `TMPDIR`, `LANG`; the zygote itself is started
  with a minimal environment, so server secrets are not even in its memory.

Not isolated / limits of this design:

* Without root (or CAP_SYS_ADMIN) there is no network namespace, no tmpfs mounts and no uid
  switch: runs get a private working directory under the sandbox's work root (removed
  afterwards) and `TMPDIR` pointing there, but can still see `/tmp`, reach the network and
  signal processes of the service's uid. Run the container with no network (compose and k8s
  do) and a tmpfs `/tmp`; `GET /health` reports which mode is active.
* Programs can read world-readable files of the host or container (e.g. `/etc`), use the
  CPU up to their limits, and see other processes in `/proc` (no PID namespace).
* The kernel is shared: this is process isolation, not a VM. Candidate code and the test
  harness share one interpreter; verdicts are decided outside it (see `harness`/`verdict`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38


def _load_libc() -> ctypes.CDLL:
    # `ctypes.util` imports subprocess, threading and random; forked runs would then pay for
    # their at-fork hooks, so it is only the fallback for a libc with another name.
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        from ctypes.util import find_library

        return ctypes.CDLL(find_library("c"), use_errno=True)


_libc = _load_libc()

SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# Plain classes rather than dataclasses: `dataclasses` imports `inspect`, about 1.5 MB of the
# zygote's heap, and every fork copies the page tables of all of it.
class Capabilities:
    """What this zygote could set up; reported by `GET /health` (as `vars()`)."""

    def __init__(self) -> None:
        self.network_namespace = False
        self.mount_namespace = False
        self.uid_switch = False
        self.cgroup: str | None = None
        self.subreaper = False
        self.notes: list[str] = []

    @property
    def mode(self) -> str:
        full = self.network_namespace and self.mount_namespace and self.uid_switch
        return "full" if full else "reduced"


class IsolationConfig:
    """How a slot's zygote isolates its runs (sent by the worker as JSON)."""

    def __init__(
        self,
        slot: int,
        uid_base: int = 61000,
        tmpfs_mb: int = 64,
        work_root: str = "/tmp/crucible-sandbox",
        want_namespaces: bool = True,
        want_cgroup: bool = True,
    ) -> None:
        self.slot, self.uid_base, self.tmpfs_mb, self.work_root = slot, uid_base, tmpfs_mb, work_root
        self.want_namespaces, self.want_cgroup = want_namespaces, want_cgroup


class CgroupFiles:
    """The zygote's cgroup, its control files opened once (a run costs a `write`, not an `open`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.procs = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        self.kill = os.open(os.path.join(path, "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
        self.events = os.open(os.path.join(path, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)

    def join(self) -> None:
        """Move the calling process into the cgroup ("0" means the writer itself)."""
        os.write(self.procs, b"0")

    def populated(self) -> bool:
        return b"populated 1" in os.pread(self.events, 128, 0)

    def kill_all(self) -> None:
        os.write(self.kill, b"1")

    def close(self) -> None:
        """Close the files and remove the (by now empty) cgroup."""
        for fd in (self.procs, self.kill, self.events):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


def _cgroup2_root() -> str | None:
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[2] == "cgroup2":
                    return parts[1]
    except OSError:
        pass
    return None


class Isolation:
    """What `setup_zygote` set up, and the per-run steps that use it.

    A run costs the zygote one fork and a few syscalls here: the cgroup files are opened
    once, and scratch directories are only listed when their tmpfs has an inode in use.
    """

    def __init__(self, cfg: IsolationConfig, caps: Capabilities, cgroup: CgroupFiles | None) -> None:
        self.cfg, self.caps, self.cgroup = cfg, caps, cgroup
        self.uid = cfg.uid_base + cfg.slot
        # Free inodes of each scratch tmpfs, freshly mounted and so empty: any other count means
        # a run left something behind (a count cannot be faked the way a timestamp can).
        self.scratch_free = (
            {d: os.statvfs(d).f_ffree for d in SCRATCH if os.path.isdir(d)} if caps.mount_namespace else {}
        )

    def workdir(self, pid: int) -> str:
        """The run's working directory: the private /tmp, or a fresh directory without one."""
        return "/tmp" if self.caps.mount_namespace else os.path.join(self.cfg.work_root, f"run-{pid}")

    def enter_run(self) -> None:
        """Called in a freshly forked run process (still privileged), before its spec is read.

        Kept to bare syscalls: every page of the zygote this touches is copied for the run.
        """
        caps = self.caps
        os.setsid()
        _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
        if self.cgroup is not None:
            try:
                self.cgroup.join()
            except OSError:
                pass  # still killed through its process group and the subreaper
        if caps.mount_namespace:
            workdir = "/tmp"
        else:
            workdir = self.workdir(os.getpid())
            os.makedirs(workdir, mode=0o700)
            os.environ["TMPDIR"] = os.environ["HOME"] = workdir
            if caps.uid_switch:
                os.chown(workdir, self.uid, self.uid)
        os.chdir(workdir)
        os.umask(0o077)

    def become_run_user(self) -> None:
        """Drop to the slot's uid: called by the harness once its spec is read, before any of it runs.

        (A process forked ahead of its run stays the zygote's until then, so nothing owned by a
        run uid outlives its run.)
        """
        if self.caps.uid_switch:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)

    def end_run(self, pid: int) -> int:
        """After the run's process was reaped: kill what it left behind and empty its scratch.

        Returns how many stray processes had to be killed.
        """
        strays = 0
        # As a subreaper the zygote inherits every orphaned descendant, and the cgroup holds
        # every process a run started; with neither showing one, nothing is left to kill.
        if not self.caps.subreaper or _children() or (self.cgroup is not None and self.cgroup.populated()):
            strays = kill_everything(pid, self.caps, cgroup=self.cgroup)
        if self.caps.mount_namespace:
            empty_scratch(self.scratch_free)
        else:
            remove_workdir(self.workdir(pid))
        return strays

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.close()


def setup_zygote(cfg: IsolationConfig) -> Isolation:
    """Run once in the zygote before it forks any run."""
    caps = Capabilities()
    caps.subreaper = _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    # Inherited by every run it forks (the zygote itself never execs; runs may, without gaining
    # privileges from setuid binaries or file capabilities).
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    root = os.geteuid() == 0
    if cfg.want_namespaces and root:
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            caps.network_namespace = True
        except OSError as e:
            caps.notes.append(f"no network namespace ({e.strerror})")
        try:
            _enter_mount_namespace(cfg)
            caps.mount_namespace = True
        except OSError as e:
            caps.notes.append(f"no private mount namespace ({e.strerror})")
        caps.uid_switch = True
    elif not root:
        caps.notes.append("not root: no namespaces and no uid switch; rely on the container")
    cgroup = _make_cgroup(cfg) if cfg.want_cgroup else None
    caps.cgroup = cgroup.path if cgroup else None
    if not caps.mount_namespace:
        os.makedirs(cfg.work_root, exist_ok=True)  # runs' private directories go here
    # Runs inherit this environment (set once here rather than rewritten in every run).
    os.environ.clear()
    os.environ.update(SAFE_ENV)
    return Isolation(cfg, caps, cgroup)


def _make_cgroup(cfg: IsolationConfig) -> CgroupFiles | None:
    root = _cgroup2_root()
    if root is None:
        return None
    path = os.path.join(root, "crucible-sandbox", f"zygote-{os.getpid()}-{cfg.slot}")
    try:
        os.makedirs(path, exist_ok=True)
        if not os.path.exists(os.path.join(path, "cgroup.kill")):
            os.rmdir(path)
            return None
        return CgroupFiles(path)
    except OSError:
        return None


def _enter_mount_namespace(cfg: IsolationConfig) -> None:
    """Give the zygote (and so its runs) private tmpfs scratch dirs, emptied after every run."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    opts = f"size={cfg.tmpfs_mb}m,mode=1777,nr_inodes=4096".encode()
    for target in SCRATCH:
        if os.path.isdir(target):
            _check(
                _libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts),
                f"mount tmpfs {target}",
            )
    _expose_python()


def _python_dirs() -> list[str]:
    import site
    import sys

    dirs = {sys.base_prefix, sys.prefix, *site.getsitepackages()}
    dirs.update(p for p in sys.path if p and os.path.isdir(p))
    return sorted(os.path.realpath(d) for d in dirs)


def _hidden_ancestor(path: str) -> str | None:
    """The top-most ancestor of `path` that other users cannot traverse (e.g. a 0700 home)."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        ancestor = "/" + "/".join(parts[:i])
        try:
            if not os.stat(ancestor).st_mode & 0o001:
                return ancestor
        except OSError:
            return None
    return None


def _expose_python() -> None:
    """Let the unprivileged run uid import from a Python installed under a private directory.

    The private ancestor is covered with an empty tmpfs (hiding the rest of it, e.g. /root),
    and only the interpreter's own directories are bound back, read-only.
    """
    MS_BIND, MS_RDONLY, MS_REMOUNT = 4096, 1, 32
    wanted = [(d, _hidden_ancestor(d)) for d in _python_dirs()]
    wanted = [(d, a) for d, a in wanted if a is not None]
    if not wanted:
        return
    fds = {d: os.open(d, os.O_PATH | os.O_DIRECTORY) for d, _ in wanted}
    try:
        for ancestor in sorted({a for _, a in wanted}):
            _check(
                _libc.mount(b"tmpfs", ancestor.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=755,size=1m"),
                "cover private dir",
            )
        for d, _ in wanted:
            os.makedirs(d, exist_ok=True)
            src = f"/proc/self/fd/{fds[d]}".encode()
            _check(_libc.mount(src, d.encode(), None, MS_BIND | MS_REC, None), f"bind {d}")
            _libc.mount(b"none", d.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None)
    finally:
        for fd in fds.values():
            os.close(fd)


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


def kill_everything(pgid: int | None, caps: Capabilities, cgroup: CgroupFiles | None = None) -> int:
    """Kill a finished run's process group, its cgroup and every re-parented descendant.

    Returns how many stray processes had to be killed after the run's own process exited.
    """
    if pgid:
        with contextlib.suppress(OSError):
            os.killpg(pgid, 9)
    if cgroup is not None:
        with contextlib.suppress(OSError):
            cgroup.kill_all()
    strays = 0
    for _ in range(200):
        live = _children()
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
    # Reap anything already dead that we were not told about.
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    return strays


SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")


def empty_scratch(free_when_empty: dict[str, int]) -> None:
    """Delete everything a run left in the zygote's private tmpfs mounts.

    A mount whose free-inode count is what it was when empty holds nothing and is not listed.
    """
    for root, free in free_when_empty.items():
        try:
            if os.statvfs(root).f_ffree == free:
                continue
            entries = os.listdir(root)
        except OSError:
            continue
        import shutil  # only when a run left something behind

        for name in entries:
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def remove_workdir(path: str) -> None:
    """Only used without a mount namespace: delete a run's private directory."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
