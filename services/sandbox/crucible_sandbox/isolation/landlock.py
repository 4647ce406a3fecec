"""Landlock: what a run may open where its slot has no mount namespace of its own.

Without root (the shipped container runs unprivileged) or where mounts are refused, the zygote
cannot build a root of its own (see `rootfs`). Landlock (Linux 5.13+, no privileges needed) gives
the same guarantees to each run's processes and all they start:

* read and execute only the trees `rootfs` would expose (/usr, /lib*, /bin, /sbin, the
  interpreter's prefix), minus the installed packages' directories, plus a few files of /etc,
  the usual /dev nodes and /proc;
* write only beneath the run's own directory (removed after it): the slot's directory in the
  ruleset, narrowed to the run's by a second layer each run adds (`restrict_writes`);
* no TCP `bind`/`connect` (ABI 4+), no signals to and no abstract Unix sockets of processes
  outside the run's own domain (ABI 6+): not the server's, the zygote's or another run's.

`Ruleset.build` runs once in the zygote; a run's process calls `restrict` before any of it runs.
Where the kernel has no Landlock, `Ruleset.build` returns None and `/health` says the file system
is the host's.
"""

from __future__ import annotations

import ctypes
import os

from crucible_sandbox.isolation import rootfs

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1, 2, 4, 8
_WRITE_TREE = (
    (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)
)
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1, 2
_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446  # the same number on every architecture
_RULE_PATH_BENEATH = 1
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV


class _Attr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _syscall(libc: ctypes.CDLL, number: int, *args: object) -> int:
    return libc.syscall(ctypes.c_long(number), *args)


def abi(libc: ctypes.CDLL) -> int:
    """The kernel's Landlock ABI version, 0 without Landlock."""
    version = _syscall(libc, _CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(version, 0)


def _split(root: str, masks: list[str]) -> list[tuple[str, bool]]:
    """(path, whole) pairs that cover `root` except the masked directories under it.

    A directory with a mask somewhere beneath it is not granted whole: only listing it (and so
    the directories beneath it), and each of its entries but the masked one.
    """
    real = os.path.realpath(root)
    inside = [m for m in masks if m == real or m.startswith(real + "/")]
    if not inside:
        return [(root, True)]
    if real in inside:
        return []
    out = [(real, False)]
    for name in os.listdir(real):
        out += _split(os.path.join(real, name), inside)
    return out


class Ruleset:
    """A Landlock ruleset, made once by the zygote and applied by each run's process."""

    def __init__(self, libc: ctypes.CDLL, fd: int, version: int, handled: int = 0) -> None:
        self.libc, self.fd, self.version, self.handled = libc, fd, version, handled

    @classmethod
    def build(cls, libc: ctypes.CDLL, writable: str) -> Ruleset | None:
        version = abi(libc)
        if version < 1:
            return None
        attr = _Attr(fs=(1 << 13) - 1, net=0, scoped=0)
        size = 8
        if version >= 2:
            attr.fs |= REFER
        if version >= 3:
            attr.fs |= TRUNCATE
        if version >= 5:
            attr.fs |= IOCTL_DEV
        if version >= 4:
            attr.net, size = NET_BIND_TCP | NET_CONNECT_TCP, 16
        if version >= 6:
            attr.scoped, size = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL, 24
        fd = _syscall(libc, _CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
        if fd < 0:
            return None
        handled = attr.fs
        ruleset = cls(libc, fd, version, handled)
        read = READ_FILE | READ_DIR | EXECUTE
        exposed = rootfs._exposed()
        masks = rootfs.masked(exposed)
        for root in exposed:
            for path, whole in _split(root, masks):
                ruleset._allow(path, read if whole else READ_DIR, handled)
        for name in rootfs.ETC:
            ruleset._allow(f"/etc/{name}", read, handled)
        for name in rootfs.DEVICES:
            ruleset._allow(f"/dev/{name}", READ_FILE | WRITE_FILE | IOCTL_DEV, handled)
        ruleset._allow("/proc", READ_FILE | READ_DIR, handled)
        ruleset._allow(writable, handled, handled)
        return ruleset

    def _allow(self, path: str, access: int, handled: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if not os.path.isdir(path):
                access &= _FILE_RIGHTS
            rule = _PathBeneath(allowed=access & handled, parent_fd=fd)
            _syscall(
                self.libc,
                _ADD_RULE,
                ctypes.c_int(self.fd),
                ctypes.c_int(_RULE_PATH_BENEATH),
                ctypes.byref(rule),
                ctypes.c_uint32(0),
            )
        finally:
            os.close(fd)

    def restrict_writes(self, directory: str | None) -> None:
        """Confine the calling process's writes further, to beneath `directory` (a run's own, made
        after this ruleset was; None: nowhere) and the device nodes: a second Landlock layer that
        handles only the rights to change files. Without it a run could write beside its
        directory, in the slot's, where the service's own uid (no uid switch) may: files that
        outlive the run."""
        handled = self.handled & ~(READ_FILE | READ_DIR | EXECUTE)
        attr = _Attr(fs=handled, net=0, scoped=0)
        fd = _syscall(self.libc, _CREATE, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
        layer = Ruleset(self.libc, fd, self.version)
        try:
            if directory is not None:
                layer._allow(directory, handled, handled)
            for name in rootfs.DEVICES:
                layer._allow(f"/dev/{name}", WRITE_FILE | IOCTL_DEV, handled)
            layer.restrict()
        finally:
            layer.close()

    def restrict(self) -> None:
        """Confine the calling process (and all it starts) to the ruleset; it needs no_new_privs."""
        if _syscall(self.libc, _RESTRICT, ctypes.c_int(self.fd), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")

    def close(self) -> None:
        os.close(self.fd)
