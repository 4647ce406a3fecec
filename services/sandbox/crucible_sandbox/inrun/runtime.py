"""What both processes of a run use: timers, resource limits, and exceptions turned into frames.

Loaded by the zygote, so every run starts with it. Nothing here decides a verdict.
"""

from __future__ import annotations

import linecache
import os
import resource
import signal
import time
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crucible_sandbox.wire.messages import ExceptionInfo, RunLimits

CANDIDATE = "<candidate>"
# Frames of the sandbox itself (any file of the package, this subpackage or another) are left out
# of the tracebacks a run reports.
_OWN_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
# Source shown in tracebacks, by file name (`<candidate>`, `<check>`, `<setup>`); handed to
# `linecache` only when a traceback is formatted.
SOURCES: dict[str, str] = {}


class TestTimeout(BaseException):
    """Raised by the per-test timer (a BaseException: `except Exception` in a program cannot eat it)."""

    __test__ = False  # not a pytest class


def _on_alarm(signum: int, frame: Any) -> None:
    raise TestTimeout()


def install_timer() -> None:
    signal.signal(signal.SIGALRM, _on_alarm)


def arm(seconds: float) -> None:
    """Raise TestTimeout in `seconds`, and every 50 ms after that (a program may swallow one)."""
    if seconds <= 0:
        raise TestTimeout()
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)


def disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)


def apply_limits(limits: RunLimits, processes: int | None, memory_mb: int | None = None) -> None:
    """rlimits of a run's process: CPU, address space, file size, open files, processes, no core."""

    def cap(res: int, value: int) -> None:
        try:
            resource.setrlimit(res, (value, value))
        except (ValueError, OSError):
            pass  # cannot raise a hard limit: the lower existing one stays

    cap(resource.RLIMIT_CPU, int(limits["cpu_time_s"]) + 1)
    cap(resource.RLIMIT_AS, int(memory_mb or limits["memory_mb"]) << 20)
    cap(resource.RLIMIT_FSIZE, int(limits["file_bytes"]))
    cap(resource.RLIMIT_NOFILE, int(limits["open_files"]))
    cap(resource.RLIMIT_CORE, 0)
    if processes:
        cap(resource.RLIMIT_NPROC, processes)


def text(value: Any, limit: int) -> str:
    """A string of at most `limit` characters, whatever `value` is (never runs its code)."""
    return value[:limit] if type(value) is str else ""


def exception_message(exc: BaseException) -> str:
    name = text(type(exc).__name__, 100) or "Exception"
    try:
        detail = str(exc)
        detail = detail if type(detail) is str else ""
    except BaseException:
        detail = ""
    return f"{name}: {detail}"[:500] if detail else name


def trimmed_traceback(exc: BaseException, limit_chars: int = 2000) -> str:
    """The traceback without the sandbox's own frames, capped in length."""
    try:
        for name, source in SOURCES.items():
            linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_OWN_DIR)]
        lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
        lines.extend(traceback.format_exception_only(type(exc), exc))
        body = "".join(lines)
    except BaseException:  # a program's exception may break formatting in any way
        body = exception_message(exc)
    return body if len(body) <= limit_chars else "...\n" + body[-limit_chars:]


def exception_info(exc: BaseException) -> ExceptionInfo:
    """What a frame says about an exception: type, message, trimmed traceback, out of memory."""
    return {
        "exc": text(type(exc).__name__, 100) or "Exception",
        "msg": exception_message(exc),
        "tb": trimmed_traceback(exc),
        "memory": isinstance(exc, MemoryError),
    }


def now() -> float:
    return time.monotonic()
