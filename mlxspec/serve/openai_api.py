"""OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, streaming (SSE) and not.

Every response carries ``usage`` (with ``prompt_tokens_details.cached_tokens``: prompt tokens the
prefix cache held) and the ``speculative`` extension object (``routes.speculative``), also on the
final streamed chunk.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from .errors import ApiError, error_body
from .prompts import completion_prompt, openai_messages, openai_tools, render
from .routes import EventStream, collect, events, first_event, new_id, read, sampling, speculative, state, submit, watch
from .schemas import ChatRequest, CompletionRequest
from .tools import ToolCall, ToolCallParser, split
from .worker import Delta, Done

router = APIRouter()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt: list[int], done: Done) -> dict:
    n = done.stats.generation_tokens
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
            "prompt_tokens_details": {"cached_tokens": done.stats.cached_tokens}}


def finish_reason(done: Done, calls: int = 0) -> str:
    if calls:
        return "tool_calls"
    return "stop" if done.finish_reason == "stop" else "length"


def tool_call(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


@router.get("/v1/models")
async def models(request: Request):
    served = state(request).served
    return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": 0, "owned_by": "mlxspec"}]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    served = state(request).served
    if model_id != served.model_id:
        raise ApiError(404, f"the model {model_id!r} is not served here; use {served.model_id!r}", param="model",
                       code="model_not_found")
    return {"id": served.model_id, "object": "model", "created": 0, "owned_by": "mlxspec"}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    server = state(request)
    body = await read(request, ChatRequest)
    tools = openai_tools(body.tools) if body.tool_choice != "none" else None
    prompt = render(server.served.tokenizer, openai_messages(body.messages), tools)
    params = sampling(server, body.temperature, body.top_p, body.top_k, body.min_p)
    job = submit(request, prompt, params, body.max_completion_tokens or body.max_tokens, body.seed, body.stops())
    watcher = watch(request, job)
    first = await first_event(job, watcher)
    meta = {"id": new_id("chatcmpl-"), "created": int(time.time()), "model": server.served.model_id}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(_chat_stream(request, job, first, meta, tools is not None, include_usage, prompt), job, watcher)
    text, done = await collect(job, watcher, first)
    content, calls = split(text) if tools else (text, [])
    message = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [tool_call(c) for c in calls]
    return JSONResponse({**meta, "object": "chat.completion",
                         "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(done, len(calls)),
                                      "logprobs": None}],
                         "usage": usage(prompt, done), "speculative": speculative(done.stats)})


async def _chat_stream(request, job, first, meta, tools: bool, include_usage: bool, prompt: list[int]):
    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return sse({**meta, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra})

    yield chunk({"role": "assistant", "content": ""})
    parser, calls = ToolCallParser() if tools else None, 0
    try:
        async for event in events(job, first):
            if isinstance(event, Delta):
                pieces = parser.feed(event.text) if parser else [event.text]
            else:
                pieces = parser.finish() if parser else []
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    yield chunk({"tool_calls": [tool_call(piece, calls)]})
                    calls += 1
                elif piece:
                    yield chunk({"content": piece})
            if isinstance(event, Done):
                yield chunk({}, finish_reason(event, calls), speculative=speculative(event.stats))
                if include_usage:
                    yield sse({**meta, "object": "chat.completion.chunk", "choices": [],
                               "usage": usage(prompt, event), "speculative": speculative(event.stats)})
    except ApiError as e:  # the worker failed mid-answer: say so in the stream
        yield sse(error_body(request.url.path, e))
    yield sse("[DONE]")


@router.post("/v1/completions")
async def completions(request: Request):
    server = state(request)
    body = await read(request, CompletionRequest)
    prompt = completion_prompt(server.served.tokenizer, body.prompt)
    params = sampling(server, body.temperature, body.top_p, body.top_k, body.min_p)
    job = submit(request, prompt, params, body.max_tokens, body.seed, body.stops())
    watcher = watch(request, job)
    first = await first_event(job, watcher)
    meta = {"id": new_id("cmpl-"), "created": int(time.time()), "model": server.served.model_id}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(_completion_stream(request, job, first, meta, include_usage, prompt), job, watcher)
    text, done = await collect(job, watcher, first)
    return JSONResponse({**meta, "object": "text_completion",
                         "choices": [{"index": 0, "text": text, "finish_reason": finish_reason(done), "logprobs": None}],
                         "usage": usage(prompt, done), "speculative": speculative(done.stats)})


async def _completion_stream(request, job, first, meta, include_usage: bool, prompt: list[int]):
    def chunk(text: str, finish: str | None = None, **extra) -> str:
        return sse({**meta, "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], **extra})

    try:
        async for event in events(job, first):
            if isinstance(event, Delta):
                if event.text:
                    yield chunk(event.text)
            else:
                yield chunk("", finish_reason(event), speculative=speculative(event.stats))
                if include_usage:
                    yield sse({**meta, "object": "text_completion", "choices": [], "usage": usage(prompt, event),
                               "speculative": speculative(event.stats)})
    except ApiError as e:
        yield sse(error_body(request.url.path, e))
    yield sse("[DONE]")
