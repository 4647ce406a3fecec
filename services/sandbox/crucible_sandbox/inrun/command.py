"""Programs that are not Python: a command started by the run's program process, and the run's files.

The program's process (see `harness`) has its uid, limits and confinement when it gets here. For a
`command` spec it writes the request's files and the artifact into the run's directory, starts
the command (a compiler, an interpreter, or a compiled executable straight from memory: the
scratch directories are `noexec`) as its child, waits for it, reads back the files asked for,
and then ends the way the command ended: the same exit status, or killed by the same signal, so
the worker reads the command's fate from this process's own wait status.

Before the fork this process makes itself non-dumpable: the command runs under the same uid, and
must not read this process's memory or its report descriptor through /proc (nor ptrace it). The
report descriptor is not inherited.

Paths a request names are relative and free of `..` (the server checks); reading them back
follows no symbolic link: every component is opened with `O_NOFOLLOW` beneath the run's
directory, and only regular files are read, through the descriptor that was checked.
"""

from __future__ import annotations

import base64
import ctypes
import os
import signal
import stat
from typing import TYPE_CHECKING, Any

from crucible_sandbox.wire.channel import write_frame

if TYPE_CHECKING:
    from crucible_sandbox.wire.messages import ProgramSpec

PR_SET_DUMPABLE = 4
FETCH_BYTES = 16 << 20  # what is read back of a run's files, all together
_EXIT_CANNOT_START = 127


def write_all(fd: int, content: bytes) -> None:
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view) :]


def write_files(files: dict[str, bytes]) -> None:
    """Create the request's files (and their directories) in the run's directory, which is empty."""
    for path, content in files.items():
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700)
        try:
            write_all(fd, content)
        finally:
            os.close(fd)


def _open_beneath(path: str) -> int | None:
    """A descriptor of the regular file `path` under the working directory, following no link."""
    parts = path.split("/")
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        out = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        return None
    return out


def read_files(paths: list[str], limit: int = FETCH_BYTES) -> dict[str, str]:
    """The regular files among `paths`, base64-encoded, up to `limit` bytes in all."""
    out: dict[str, str] = {}
    left = limit
    for path in paths:
        fd = _open_beneath(path)
        if fd is None:
            continue
        try:
            data = os.read(fd, left + 1)
            chunks = [data]
            while data and sum(map(len, chunks)) <= left:
                data = os.read(fd, left + 1)
                chunks.append(data)
        finally:
            os.close(fd)
        body = b"".join(chunks)
        if len(body) > left:
            break
        left -= len(body)
        out[path] = base64.b64encode(body).decode()
    return out


def read_dir(directory: str) -> dict[str, str]:
    """Every regular file directly in `directory` (a compile step's `out/`), base64-encoded."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return {}
    return read_files([f"{directory}/{n}" for n in names])


def run_command(run: ProgramSpec, report_fd: int) -> None:
    """Start the spec's command, wait for it, report, and end as it ended. Never returns."""
    write_files(run.get("files") or {})
    for directory in run.get("mkdir") or []:
        os.makedirs(directory, exist_ok=True)
    exe = run.get("exe")
    exe_fd = None
    if exe is not None:
        exe_fd = os.memfd_create("program", os.MFD_CLOEXEC)
        write_all(exe_fd, exe)
    # The run's scratch: /tmp in a root of its own, else the run's directory (see `isolation.confine`).
    tmp = os.environ.get("TMPDIR", "/tmp")
    argv = run.get("argv") or ["false"]
    env = {k: v.replace("{tmp}", tmp) for k, v in (run.get("env") or {}).items()}
    os.set_inheritable(report_fd, False)
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        try:
            if exe_fd is not None:
                os.execve(exe_fd, argv, env)
            else:
                os.execvpe(argv[0], argv, env)
        except BaseException as exc:
            os.write(2, f"cannot start {argv[0]}: {exc}\n".encode(errors="replace"))
        os._exit(_EXIT_CANNOT_START)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    frames: list[dict[str, Any]] = []
    collect = run.get("collect")
    if collect:
        frames.append({"t": "files", "files": read_dir(collect)})
    elif run.get("fetch"):
        frames.append({"t": "files", "files": read_files(run.get("fetch") or [])})
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        frames.append({"t": "done"} if code == 0 else {"t": "exit", "code": str(code)})
    for frame in frames:
        write_frame(report_fd, frame)
    for fd in (1, 2, report_fd):
        try:
            os.close(fd)
        except OSError:
            pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        code = 128 + sig
    os._exit(code)
