"""The generator's routes, with vLLM's paths: thin, each hands its request to `GeneratorService`.

`create_app` (in `api`) includes `router`; a route finds the app's one service, which the
lifespan hook builds, through the dependency `Service`. A completion is cancelled when its client
hangs up (`until_disconnect`): its sequences leave the batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

from crucible_shared.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .service import GeneratorService

T = TypeVar("T")

ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorResponse} for status in (400, 404, 500)}


def service(request: Request) -> GeneratorService:
    """The app's one `GeneratorService` (the lifespan hook puts it on `app.state`)."""
    return request.app.state.service


Service = Annotated[GeneratorService, Depends(service)]


class ClientGone(Exception):
    """The client hung up before its completion was ready."""


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.5) -> T:
    """Await `work`, cancelling it if the client disconnects first (its sequences leave the batch)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise ClientGone


router = APIRouter()


@router.get("/health", responses=ERRORS)
async def health() -> Response:
    return Response(status_code=200)


@router.get("/metrics", responses=ERRORS)
async def metrics(service: Service) -> Response:
    return Response(service.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def models(service: Service) -> ModelList:
    return service.list_models()


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request, service: Service) -> Response:
    if body.stream:  # server-sent events; a client that hangs up stops the stream and its sequences
        return StreamingResponse(service.complete_stream(body), media_type="text/event-stream")
    result = await until_disconnect(request, service.complete(body))
    return JSONResponse(result.model_dump())


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, service: Service) -> Response:
    if body.stream:
        return StreamingResponse(service.chat_stream(body), media_type="text/event-stream")
    result = await until_disconnect(request, service.chat(body))
    return JSONResponse(result.model_dump())


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, service: Service) -> PlainTextResponse:
    return PlainTextResponse(await service.load_adapter(body))


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, service: Service) -> PlainTextResponse:
    return PlainTextResponse(await service.unload_adapter(body))
