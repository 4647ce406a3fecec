"""Errors the generator answers with, each carrying vLLM's HTTP status and error `type`.

`GeneratorError.to_response()` gives vLLM's `ErrorResponse` body:
`{"error": {"message": ..., "type": "NotFoundError", "param": "model", "code": 404}}`.
"""

from __future__ import annotations

from http import HTTPStatus

from crucible_shared.openai_protocol import ErrorInfo, ErrorResponse


class GeneratorError(Exception):
    """A request the generator refuses; `status`/`type` mirror what vLLM answers in the same case."""

    status: HTTPStatus = HTTPStatus.BAD_REQUEST
    type: str = "BadRequestError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status.value)
        )


class BadRequest(GeneratorError):
    """Invalid sampling parameters or prompt (vLLM's `VLLMValidationError`)."""


class InvalidUserInput(GeneratorError):
    """Invalid adapter load/unload request, e.g. a name that is already loaded."""

    type = "InvalidUserInput"


class NotFound(GeneratorError):
    """Unknown model or adapter, or an adapter path without an adapter."""

    status = HTTPStatus.NOT_FOUND
    type = "NotFoundError"


class ServerError(GeneratorError):
    """Something failed inside the server."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR
    type = "InternalServerError"
