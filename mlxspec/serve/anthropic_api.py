"""Anthropic's Messages API: a validated request → a job → the message, whole or streamed as the
events the Anthropic SDK reads (``message_start``, ``content_block_*``, ``message_delta``, ``message_stop``).

``usage.input_tokens`` counts the prompt tokens prefilled, ``usage.cache_read_input_tokens`` those the
prefix cache held (their sum is the prompt, as Anthropic counts them); the speculation stats are in
the ``speculative`` extension object (on the message, and on the streamed ``message_delta``).
"""

from __future__ import annotations

import json

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
from .prompts import anthropic_messages, anthropic_tools, render
from .schemas.anthropic import (
    AnthropicUsage,
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextOut,
    TokenCount,
    ToolUseOut,
)
from .tools import ToolCall, ToolCallParser, split
from .worker import Delta, Done


def event(kind: str, data: dict) -> str:
    """One server-sent event of ``kind`` (its ``type``), ``data`` holding plain values."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def usage(prompt: list[int], cached: int, output_tokens: int) -> AnthropicUsage:
    return AnthropicUsage(
        input_tokens=len(prompt) - cached, output_tokens=output_tokens, cache_read_input_tokens=cached
    )


def stop_reason(done: Done, stops: list[str], calls: int) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``; the stop sequence is named when only one was given (the
    generator reports that a stop string ended the answer, not which)."""
    if calls:
        return "tool_use", None
    if done.stop_string:
        return "stop_sequence", stops[0] if len(stops) == 1 else None
    return ("end_turn", None) if done.finish_reason == "stop" else ("max_tokens", None)


def tool_use(call: ToolCall) -> ToolUseOut:
    return ToolUseOut(id="toolu_" + call.id.removeprefix("call_"), name=call.name, input=call.input)


def _tools(body: MessagesRequest) -> list[dict] | None:
    """The request's tools as OpenAI function tools, or ``None`` (none given, or ``tool_choice`` none)."""
    no_tools = body.tool_choice is not None and body.tool_choice.get("type") == "none"
    return None if no_tools else anthropic_tools(body.tools)


def _prompt(request: Request, body: MessagesRequest) -> list[int]:
    """The prompt; a last ``assistant`` message is a prefill the answer continues (an empty one is dropped).

    Raises:
        ApiError: 400 for a prefill ending in whitespace (as Anthropic refuses it), or what ``render`` raises.
    """
    messages = anthropic_messages(body)
    prefill = body.messages[-1].role == "assistant"
    if prefill and not messages[-1]["content"] and "tool_calls" not in messages[-1]:
        messages, prefill = messages[:-1], False
    if prefill and messages[-1]["content"] != messages[-1]["content"].rstrip():
        where = f"messages.{len(body.messages) - 1}.content"
        raise ApiError(
            400,
            f"{where}: a final assistant message (a prefill) cannot end with whitespace; strip it",
            param=where,
        )
    return render(state(request).served.tokenizer, messages, _tools(body), prefill=prefill)


async def messages(request: Request, body: MessagesRequest):
    """Answer ``POST /v1/messages`` (``body`` validated and accepted)."""
    server = state(request)
    prompt, tools = _prompt(request, body), _tools(body)
    params = sampling(server, body.temperature, body.top_p, body.top_k)
    stops = list(body.stop_sequences or [])
    job = submit(request, prompt, params, body.max_tokens, None, stops)
    watcher = watch(request, job)
    first = await first_event(job, watcher)
    meta = {"id": new_id("msg_"), "model": server.served.model_id}
    if body.stream:
        parser = ToolCallParser(server.tool_format, tools) if tools else None
        return EventStream(_stream(request, job, first, meta, parser, prompt, stops), job, watcher)
    text, done = await collect(job, watcher, first)
    content, calls = split(text, server.tool_format, tools) if tools else (text, [])
    blocks = ([TextOut(text=content)] if content or not calls else []) + [tool_use(c) for c in calls]
    reason, sequence = stop_reason(done, stops, len(calls))
    message = Message(
        **meta,
        content=blocks,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=usage(prompt, done.stats.cached_tokens, done.stats.generation_tokens),
        speculative=speculative(done.stats),
    )
    return JSONResponse(message.model_dump(mode="json"))


def count_tokens(request: Request, body: CountTokensRequest) -> TokenCount:
    """Answer ``POST /v1/messages/count_tokens``: the prompt's tokens as the template renders it."""
    return TokenCount(input_tokens=len(_prompt(request, body)))


async def _stream(
    request, job, first, meta: dict, parser: ToolCallParser | None, prompt: list[int], stops: list[str]
):
    cached = first.cached if isinstance(first, Delta) else first.stats.cached_tokens
    start = Message(**meta, content=[], stop_reason=None, stop_sequence=None, usage=usage(prompt, cached, 0))
    yield event("message_start", {"message": start.model_dump(mode="json")})
    yield event("ping", {})
    index, text_open, calls, output = 0, False, 0, 0
    try:
        async for item in events(job, first):
            if isinstance(item, Delta):
                output += item.tokens
                pieces = parser.feed(item.text) if parser else [item.text]
            else:
                pieces = parser.finish() if parser else []
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    if text_open:
                        yield event("content_block_stop", {"index": index})
                        index, text_open = index + 1, False
                    block = tool_use(piece).model_dump(mode="json")
                    yield event(
                        "content_block_start", {"index": index, "content_block": {**block, "input": {}}}
                    )
                    yield event(
                        "content_block_delta",
                        {
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": piece.arguments},
                        },
                    )
                    yield event("content_block_stop", {"index": index})
                    index, calls = index + 1, calls + 1
                elif piece:
                    if not text_open:
                        yield event(
                            "content_block_start",
                            {"index": index, "content_block": {"type": "text", "text": ""}},
                        )
                        text_open = True
                    yield event(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "text_delta", "text": piece}},
                    )
            if isinstance(item, Done):
                if not text_open and index == 0:  # an empty answer is one empty text block
                    yield event(
                        "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
                    )
                    text_open = True
                if text_open:
                    yield event("content_block_stop", {"index": index})
                reason, sequence = stop_reason(item, stops, calls)
                final = usage(prompt, item.stats.cached_tokens, item.stats.generation_tokens)
                yield event(
                    "message_delta",
                    {
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": final.model_dump(mode="json"),
                        "speculative": speculative(item.stats).model_dump(mode="json"),
                    },
                )
                yield event("message_stop", {})
    except ApiError as e:
        body = error_body(request.url.path, e)
        yield event("error", {"error": body["error"]})
