"""Options and helpers every gateway command shares."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from crucible_shared.gateway_client import GatewayClient

GATEWAY = typer.Option(
    os.environ.get("CRUCIBLE_GATEWAY_URL", "http://127.0.0.1:8000"),
    "--gateway",
    help="Gateway URL (env CRUCIBLE_GATEWAY_URL).",
)
API_KEY = typer.Option(
    os.environ.get("CRUCIBLE_API_KEY"), "--api-key", help="Gateway API key (env CRUCIBLE_API_KEY)."
)
DETACH = typer.Option(False, "--detach", help="Submit and return without following the job.")
RAW = typer.Option(False, "--json", help="Print the raw events as JSON lines (for scripts).")
SAMPLES = typer.Option(
    False, "--samples", help="Also print a sampled completion and its feedback now and then."
)

# A job run in this process instead of on the gateway's worker (`train`, `pipeline`).
LOCAL = typer.Option(False, "--local", help="Run here instead of submitting to the gateway.")
LOCAL_GENERATORS = typer.Option(None, "--generator", help="--local: generator URL (repeat for replicas).")
LOCAL_SANDBOX = typer.Option(None, "--sandbox", help="--local: sandbox URL.")
LOCAL_RUNS_DIR = typer.Option(None, "--runs-dir", help="--local: where run dirs go (default runs/jobs).")


def client(url: str, key: str | None, timeout: float = 30.0):
    from crucible_shared.gateway_client import GatewayClient

    return GatewayClient(url, key, timeout=timeout)


@contextmanager
def gateway_session(url: str, key: str | None, timeout: float = 30.0) -> Iterator[GatewayClient]:
    """The gateway's client, open for the block; a gateway error or an unreachable gateway in the
    block exits 1 with its message (`gateway_failure`)."""
    from crucible_shared.gateway_client import GatewayError

    try:
        with client(url, key, timeout) as gw:
            yield gw
    except (GatewayError, OSError) as exc:
        gateway_failure(exc)


def fail(message: object, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def gateway_failure(exc: Exception) -> NoReturn:
    """Exit 1 with the gateway's message, plus a hint when it is not reachable at all."""
    from crucible_shared.gateway_client import GatewayUnreachable

    hint = (
        " (is the stack up? start it with `crucible up`)"
        if isinstance(exc, GatewayUnreachable | OSError)
        else ""
    )
    fail(f"{exc}{hint}")
