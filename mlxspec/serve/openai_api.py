"""OpenAI's chat completions and completions: a validated request → a job → the answer, whole or
streamed (server-sent events, as the ``openai`` client reads them).

Every answer carries ``usage`` (with ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix
cache held) and the ``speculative`` extension object, also on the final streamed chunk.
"""

from __future__ import annotations

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from .errors import ApiError, error_body
from .jobs import (
    EventStream,
    collect,
    events,
    first_event,
    new_id,
    sampling,
    speculative,
    state,
    submit,
    watch,
)
from .prompts import completion_prompt, openai_messages, openai_tools, render
from .schemas.base import Reply
from .schemas.openai import (
    AssistantMessage,
    CalledFunction,
    CalledTool,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from .tools import ToolCall, ToolCallParser, split
from .worker import Delta, Done


def sse(data: Reply | dict | str) -> str:
    """One server-sent event's ``data:`` line."""
    if isinstance(data, Reply):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(prompt: list[int], done: Done) -> Usage:
    n = done.stats.generation_tokens
    return Usage(
        prompt_tokens=len(prompt),
        completion_tokens=n,
        total_tokens=len(prompt) + n,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.stats.cached_tokens),
    )


def finish_reason(done: Done, calls: int = 0) -> str:
    if calls:
        return "tool_calls"
    return "stop" if done.finish_reason == "stop" else "length"


def called(call: ToolCall, index: int | None = None) -> CalledTool:
    return CalledTool(
        index=index, id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments)
    )


def _meta(request: Request, prefix: str) -> dict:
    return {"id": new_id(prefix), "created": int(time.time()), "model": state(request).served.model_id}


async def chat(request: Request, body: ChatRequest):
    """Answer ``POST /v1/chat/completions`` (``body`` validated and accepted)."""
    server = state(request)
    tools = openai_tools(body.tools) if body.tool_choice != "none" else None
    prompt = render(server.served.tokenizer, openai_messages(body.messages), tools)
    params = sampling(server, body.temperature, body.top_p, body.top_k, body.min_p)
    job = submit(
        request, prompt, params, body.max_completion_tokens or body.max_tokens, body.seed, body.stops()
    )
    watcher = watch(request, job)
    first = await first_event(job, watcher)
    meta = _meta(request, "chatcmpl-")
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        parser = ToolCallParser(server.tool_format, tools) if tools else None
        return EventStream(
            _chat_stream(request, job, first, meta, parser, include_usage, prompt), job, watcher
        )
    text, done = await collect(job, watcher, first)
    content, calls = split(text, server.tool_format, tools) if tools else (text, [])
    message = AssistantMessage(
        content=content if content or not calls else None, tool_calls=[called(c) for c in calls] or None
    )
    reply = ChatCompletion(
        **meta,
        choices=[ChatChoice(message=message, finish_reason=finish_reason(done, len(calls)))],
        usage=usage(prompt, done),
        speculative=speculative(done.stats),
    )
    return JSONResponse(reply.model_dump(mode="json"))


async def _chat_stream(
    request, job, first, meta, parser: ToolCallParser | None, include_usage: bool, prompt: list[int]
):
    def chunk(delta: ChunkDelta, finish: str | None = None, **extra) -> str:
        return sse(
            ChatCompletionChunk(**meta, choices=[ChunkChoice(delta=delta, finish_reason=finish)], **extra)
        )

    yield chunk(ChunkDelta(role="assistant", content=""))
    calls = 0
    try:
        async for event in events(job, first):
            if isinstance(event, Delta):
                pieces = parser.feed(event.text) if parser else [event.text]
            else:
                pieces = parser.finish() if parser else []
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    yield chunk(ChunkDelta(tool_calls=[called(piece, calls)]))
                    calls += 1
                elif piece:
                    yield chunk(ChunkDelta(content=piece))
            if isinstance(event, Done):
                yield chunk(ChunkDelta(), finish_reason(event, calls), speculative=speculative(event.stats))
                if include_usage:
                    yield sse(
                        ChatCompletionChunk(
                            **meta,
                            choices=[],
                            usage=usage(prompt, event),
                            speculative=speculative(event.stats),
                        )
                    )
    except ApiError as e:  # the worker failed mid-answer: say so in the stream
        yield sse(error_body(request.url.path, e))
    yield sse("[DONE]")


async def complete(request: Request, body: CompletionRequest):
    """Answer ``POST /v1/completions`` (``body`` validated and accepted)."""
    server = state(request)
    prompt = completion_prompt(server.served.tokenizer, body.prompt)
    params = sampling(server, body.temperature, body.top_p, body.top_k, body.min_p)
    job = submit(request, prompt, params, body.max_tokens, body.seed, body.stops())
    watcher = watch(request, job)
    first = await first_event(job, watcher)
    meta = _meta(request, "cmpl-")
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(_completion_stream(request, job, first, meta, include_usage, prompt), job, watcher)
    text, done = await collect(job, watcher, first)
    reply = Completion(
        **meta,
        choices=[CompletionChoice(text=text, finish_reason=finish_reason(done))],
        usage=usage(prompt, done),
        speculative=speculative(done.stats),
    )
    return JSONResponse(reply.model_dump(mode="json"))


async def _completion_stream(request, job, first, meta, include_usage: bool, prompt: list[int]):
    def chunk(text: str, finish: str | None = None, **extra) -> str:
        return sse(Completion(**meta, choices=[CompletionChoice(text=text, finish_reason=finish)], **extra))

    try:
        async for event in events(job, first):
            if isinstance(event, Delta):
                if event.text:
                    yield chunk(event.text)
            else:
                yield chunk("", finish_reason(event), speculative=speculative(event.stats))
                if include_usage:
                    yield sse(
                        Completion(
                            **meta,
                            choices=[],
                            usage=usage(prompt, event),
                            speculative=speculative(event.stats),
                        )
                    )
    except ApiError as e:
        yield sse(error_body(request.url.path, e))
    yield sse("[DONE]")
