"""Every HTTP route of the server: its path, its body (validated by FastAPI from the ``schemas``), its
answer; the work is in each API's module (``openai_api``, ``anthropic_api``)."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response

from . import anthropic_api, openai_api, responses_api
from .errors import ApiError
from .jobs import accept, state
from .schemas.anthropic import CountTokensRequest, Message, MessagesRequest, TokenCount
from .schemas.openai import ChatCompletion, ChatRequest, Completion, CompletionRequest, ModelCard, ModelList
from .schemas.responses import Response as ResponseObject
from .schemas.responses import ResponsesRequest

router = APIRouter()


def streamed(what: str) -> dict:
    """OpenAPI's note that with ``stream: true`` the answer is server-sent events of ``what``."""
    return {200: {"content": {"text/event-stream": {"schema": {"type": "string", "description": what}}}}}


class Health(BaseModel):
    status: str
    model: str
    drafter: str
    queued: int
    busy: bool
    rows: int = Field(description="requests running together (prefilling or decoding)")


@router.get("/health", response_model=Health, tags=["server"])
async def health(request: Request):
    server = state(request)
    return Health(status="ok", model=server.served.model_id, drafter=server.served.drafter,
                  queued=server.worker.queued, busy=server.worker.busy, rows=server.worker.rows)


@router.get("/metrics", tags=["server"], response_class=Response)
async def metrics(request: Request):
    """Prometheus text."""
    return Response(generate_latest(state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList, tags=["openai"])
async def models(request: Request):
    return ModelList(data=[ModelCard(id=state(request).served.model_id)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, tags=["openai"])
async def model(request: Request, model_id: str):
    served = state(request).served
    if model_id != served.model_id:
        raise ApiError(
            404,
            f"the model {model_id!r} is not served here; use {served.model_id!r}",
            param="model",
            code="model_not_found",
        )
    return ModelCard(id=served.model_id)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    tags=["openai"],
    responses=streamed("chat.completion.chunk objects (ChatCompletionChunk), then [DONE]"),
)
async def chat_completions(request: Request, body: ChatRequest):
    accept(request, body)
    return await openai_api.chat(request, body)


@router.post(
    "/v1/completions",
    response_model=Completion,
    tags=["openai"],
    responses=streamed("text_completion objects, then [DONE]"),
)
async def completions(request: Request, body: CompletionRequest):
    accept(request, body)
    return await openai_api.complete(request, body)


@router.post(
    "/v1/messages",
    response_model=Message,
    tags=["anthropic"],
    responses=streamed("message_start, content_block_start/delta/stop, message_delta, message_stop"),
)
async def messages(request: Request, body: MessagesRequest):
    accept(request, body)
    return await anthropic_api.messages(request, body)


@router.post("/v1/messages/count_tokens", response_model=TokenCount, tags=["anthropic"])
async def count_tokens(request: Request, body: CountTokensRequest):
    """The prompt's token count as the template renders it (Claude Code asks before sending)."""
    accept(request, body)
    return anthropic_api.count_tokens(request, body)


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    tags=["openai"],
    responses=streamed(
        "response.created, response.output_item.added, response.output_text.delta, ..., "
        "response.completed (or response.incomplete)"
    ),
)
async def responses(request: Request, body: ResponsesRequest):
    """OpenAI's Responses API, stateless (no ``store``, no ``previous_response_id``)."""
    accept(request, body)
    return await responses_api.respond(request, body)
