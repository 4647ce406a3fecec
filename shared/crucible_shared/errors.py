"""The one JSON error envelope every Crucible HTTP service answers with.

`{"error": {"code": "invalid_request", "message": "...", "field": "runs.0.code", "status": 422}}`
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    """What went wrong, in one place a client can rely on."""

    code: str = Field(description="Stable machine-readable error code, e.g. `invalid_request`.")
    message: str = Field(description="Human-readable explanation saying what to fix.")
    status: int = Field(description="The HTTP status code, repeated for clients that lose it.")
    field: str | None = Field(default=None, description="Dotted path of the offending field, if any.")
    details: list[dict] | None = Field(
        default=None, description="Every validation problem, when there were several."
    )


class ErrorEnvelope(BaseModel):
    """Body of every non-2xx response."""

    error: ErrorDetail
