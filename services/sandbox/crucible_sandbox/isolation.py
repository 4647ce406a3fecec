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
import ctypes.util
import os
import time
from dataclasses import dataclass, field

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


@dataclass
class Capabilities:
    """What this zygote could set up; reported by `GET /health`."""

    network_namespace: bool = False
    mount_namespace: bool = False
    uid_switch: bool = False
    cgroup: str | None = None
    subreaper: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        full = self.network_namespace and self.mount_namespace and self.uid_switch
        return "full" if full else "reduced"


@dataclass
class IsolationConfig:
    slot: int
    uid_base: int = 61000
    tmpfs_mb: int = 64
    work_root: str = "/tmp/crucible-sandbox"
    want_namespaces: bool = True
    want_cgroup: bool = True


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


def setup_zygote(cfg: IsolationConfig) -> Capabilities:
    """Run once in the zygote before it forks any run."""
    caps = Capabilities()
    caps.subreaper = _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
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
    if cfg.want_cgroup:
        caps.cgroup = _make_cgroup(cfg)
    os.makedirs(cfg.work_root, exist_ok=True)
    return caps


def _make_cgroup(cfg: IsolationConfig) -> str | None:
    root = _cgroup2_root()
    if root is None:
        return None
    path = os.path.join(root, "crucible-sandbox", f"zygote-{os.getpid()}-{cfg.slot}")
    try:
        os.makedirs(path, exist_ok=True)
        if not os.path.exists(os.path.join(path, "cgroup.kill")):
            os.rmdir(path)
            return None
        return path
    except OSError:
        return None


def _enter_mount_namespace(cfg: IsolationConfig) -> None:
    """Give the zygote (and so its runs) private tmpfs scratch dirs, emptied after every run."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    opts = f"size={cfg.tmpfs_mb}m,mode=1777,nr_inodes=4096".encode()
    for target in (b"/tmp", b"/var/tmp", b"/dev/shm"):
        if os.path.isdir(target):
            _check(
                _libc.mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"mount tmpfs {target!r}"
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


def enter_run(cfg: IsolationConfig, caps: Capabilities) -> str:
    """Called in a freshly forked run process (still privileged). Returns its working directory."""
    os.setsid()
    _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if caps.cgroup:
        try:
            with open(os.path.join(caps.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass
    if caps.mount_namespace:
        workdir = "/tmp"
    else:
        workdir = os.path.join(cfg.work_root, f"run-{os.getpid()}")
        os.makedirs(workdir, mode=0o700)
    if caps.uid_switch:
        uid = cfg.uid_base + cfg.slot
        if not caps.mount_namespace:
            os.chown(workdir, uid, uid)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(SAFE_ENV)
    if not caps.mount_namespace:
        os.environ["TMPDIR"] = workdir
        os.environ["HOME"] = workdir
    os.umask(0o077)
    return workdir


def _children() -> list[int]:
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def kill_everything(pgid: int | None, caps: Capabilities, spare: set[int] | None = None) -> int:
    """Kill a finished run's process group, its cgroup and every re-parented descendant.

    Returns how many stray processes had to be killed after the run's own process exited.
    """
    if pgid:
        with contextlib.suppress(OSError):
            os.killpg(pgid, 9)
    if caps.cgroup:
        try:
            with open(os.path.join(caps.cgroup, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass
    spare = spare or set()
    strays = 0
    for _ in range(200):
        live = [p for p in _children() if p not in spare]
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


def empty_scratch() -> None:
    """Delete everything a run left in the zygote's private tmpfs mounts."""
    import shutil

    for root in SCRATCH:
        try:
            entries = os.listdir(root)
        except OSError:
            continue
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
