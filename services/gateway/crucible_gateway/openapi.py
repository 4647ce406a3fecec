"""What the gateway's OpenAPI document declares beyond what FastAPI infers from the routes: the
schemas of the job events `GET /v1/jobs/{id}/events` streams (`crucible_shared.events`)."""

from __future__ import annotations

from typing import Any

from crucible_shared.events import sse_components
from fastapi import FastAPI


def with_event_schemas(app: FastAPI) -> FastAPI:
    """`app` whose OpenAPI document holds every event type's schema (the stream route refers to
    them through `crucible_shared.events.sse_openapi`)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(sse_components())
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
