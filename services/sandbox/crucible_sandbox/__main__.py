"""`crucible-sandbox` / `python -m crucible_sandbox`: serve the sandbox API."""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Serve the Crucible sandbox (settings: CRUCIBLE_SANDBOX_* env vars)."
    )
    parser.add_argument("--host", help="bind address (default from settings)")
    parser.add_argument("--port", type=int, help="port (default 8002)")
    parser.add_argument("--workers", type=int, help="zygote worker slots (default: CPU count)")
    args = parser.parse_args()

    from pydantic import ValidationError

    from crucible_sandbox.server.settings import Settings

    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        settings = Settings(**overrides)
    except (ValidationError, ValueError) as exc:
        raise SystemExit(
            f"crucible-sandbox: invalid settings (CRUCIBLE_SANDBOX_* environment variables):\n{exc}"
        ) from None

    from crucible_sandbox.server.service import unsafe_start

    refusal = unsafe_start(settings)
    if refusal:
        raise SystemExit(f"crucible-sandbox: {refusal}")

    import uvicorn

    from crucible_sandbox.isolation.confine import undumpable
    from crucible_sandbox.server.api import create_app

    # Its environment holds the API keys: where runs share the server's uid (no uid switch), this
    # keeps them from reading /proc/<server>/environ or its memory.
    undumpable()

    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
