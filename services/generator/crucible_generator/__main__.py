"""`python -m crucible_generator`: serve the generator over HTTP.

Options override the `CRUCIBLE_GENERATOR_*` environment. Settings are parsed before torch is
imported, so `--help` and configuration errors answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pydantic import ValidationError

from .settings import Settings


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="crucible-generator",
        description="vLLM-compatible completions server with hot-swappable LoRA adapters (transformers + PEFT).",
    )
    for name, field in Settings.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=field.description)
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    try:
        return Settings(**args)
    except ValidationError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    # Sleeping (not spinning) OpenMP workers: on a CPU host shared with other torch processes
    # (trainer, sandbox, tests), spinning workers slow every process down by an order of magnitude.
    # Must be set before torch loads its OpenMP runtime; an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import uvicorn

    from .api import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)


if __name__ == "__main__":
    main(sys.argv[1:])
