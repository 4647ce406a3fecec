"""`crucible-gateway` / `python -m crucible_gateway`: serve the job API."""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Serve the Crucible gateway (settings: CRUCIBLE_GATEWAY_* and REDIS_URL)."
    )
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()

    from pydantic import ValidationError

    from crucible_gateway.settings import Settings

    try:
        settings = Settings(**{k: v for k, v in vars(args).items() if v is not None})
    except (ValidationError, ValueError) as exc:
        raise SystemExit(f"crucible-gateway: invalid settings:\n{exc}") from None

    import uvicorn

    from crucible_gateway.api import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
