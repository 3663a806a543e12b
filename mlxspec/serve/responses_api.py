"""OpenAI's Responses API, ``POST /v1/responses``, stateless: a validated request → a job → the response,
whole or streamed as the ``response.*`` events the ``openai`` client reads (``responses.create(...,
stream=True)``): ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, its text (``response.content_part.added``, ``response.output_text.delta``
..., ``.done``) or a function call's arguments (``response.function_call_arguments.delta``, ``.done``),
``response.output_item.done``, and last ``response.completed`` (or ``response.incomplete`` at
``max_output_tokens``). The response carries the ``speculative`` extension object.
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
from .prompts import render, responses_messages
from .schemas.responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    Response,
    ResponsesRequest,
    ResponseUsage,
)
from .tools import ToolCall, ToolCallParser, split
from .worker import Delta, Done


def _tools(body: ResponsesRequest) -> list[dict] | None:
    """The request's function tools as chat templates take them, or ``None`` (none given, or
    ``tool_choice`` none)."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in body.tools
    ]


def function_call(call: ToolCall, status: str = "completed") -> FunctionCallItem:
    return FunctionCallItem(
        id="fc_" + call.id.removeprefix("call_"),
        call_id=call.id,
        name=call.name,
        arguments=call.arguments,
        status=status,
    )


def message(text: str, status: str = "completed") -> OutputMessage:
    return OutputMessage(id=new_id("msg_"), status=status, content=[OutputText(text=text)])


def finished(meta: dict, prompt: list[int], done: Done, output: list) -> Response:
    """The whole response once ``done``: ``incomplete`` when ``max_output_tokens`` (or the timeout) cut it."""
    cut = done.finish_reason != "stop"
    n = done.stats.generation_tokens
    usage = ResponseUsage(
        input_tokens=len(prompt),
        input_tokens_details=InputTokensDetails(cached_tokens=done.stats.cached_tokens),
        output_tokens=n,
        total_tokens=len(prompt) + n,
    )
    return Response(
        **meta,
        status="incomplete" if cut else "completed",
        output=output,
        incomplete_details=IncompleteDetails() if cut else None,
        usage=usage,
        speculative=speculative(done.stats),
    )


async def respond(request: Request, body: ResponsesRequest):
    """Answer ``POST /v1/responses`` (``body`` validated and accepted)."""
    server = state(request)
    tools = _tools(body)
    prompt = render(server.served.tokenizer, responses_messages(body), tools)
    params = sampling(server, body.temperature, body.top_p, None)
    job = submit(request, prompt, params, body.max_output_tokens, None, [])
    watcher = watch(request, job)
    first = await first_event(job, watcher)
    meta = {
        "id": new_id("resp_"),
        "created_at": int(time.time()),
        "model": server.served.model_id,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
    }
    if body.stream:
        parser = ToolCallParser(server.tool_format, tools) if tools else None
        return EventStream(_stream(request, job, first, meta, parser, prompt), job, watcher)
    text, done = await collect(job, watcher, first)
    content, calls = split(text, server.tool_format, tools) if tools else (text, [])
    status = "incomplete" if done.finish_reason != "stop" else "completed"
    output = ([message(content, status)] if content or not calls else []) + [function_call(c) for c in calls]
    return JSONResponse(finished(meta, prompt, done, output).model_dump(mode="json"))


class _Output:
    """The streamed output items as ``response.*`` events: a message item opened at the first text and
    closed at a function call or the end; each call one item."""

    def __init__(self):
        self.sequence, self.items, self.open, self.texts = 0, [], None, []

    def event(self, kind: str, **data) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def text(self, piece: str) -> list[str]:
        lines, index = [], len(self.items)
        if self.open is None:
            self.open, self.texts = message("", "in_progress").model_copy(update={"content": []}), []
            lines += [
                self.event("response.output_item.added", output_index=index, item=_json(self.open)),
                self.event(
                    "response.content_part.added",
                    item_id=self.open.id,
                    output_index=index,
                    content_index=0,
                    part=_json(OutputText(text="")),
                ),
            ]
        if piece:
            self.texts.append(piece)
            lines.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.open.id,
                    output_index=index,
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                )
            )
        return lines

    def call(self, call: ToolCall) -> list[str]:
        lines, item = self.close(), function_call(call)
        index, added = len(self.items), item.model_copy(update={"arguments": "", "status": "in_progress"})
        self.items.append(item)
        return lines + [
            self.event("response.output_item.added", output_index=index, item=_json(added)),
            self.event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=index,
                delta=item.arguments,
            ),
            self.event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=_json(item)),
        ]

    def close(self, status: str = "completed") -> list[str]:
        """End the open message item, if any."""
        if self.open is None:
            return []
        part, index = OutputText(text="".join(self.texts)), len(self.items)
        item = self.open.model_copy(update={"status": status, "content": [part]})
        self.items.append(item)
        self.open = None
        return [
            self.event(
                "response.output_text.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=_json(part),
            ),
            self.event("response.output_item.done", output_index=index, item=_json(item)),
        ]


def _json(model) -> dict:
    return model.model_dump(mode="json")


async def _stream(request, job, first, meta: dict, parser: ToolCallParser | None, prompt: list[int]):
    out = _Output()
    start = _json(Response(**meta, status="in_progress", output=[]))
    yield out.event("response.created", response=start)
    yield out.event("response.in_progress", response=start)
    try:
        async for item in events(job, first):
            if isinstance(item, Delta):
                pieces = parser.feed(item.text) if parser else [item.text]
            else:
                pieces = parser.finish() if parser else []
            for piece in pieces:
                for line in (
                    out.call(piece) if isinstance(piece, ToolCall) else out.text(piece) if piece else []
                ):
                    yield line
            if isinstance(item, Done):
                status = "completed" if item.finish_reason == "stop" else "incomplete"
                lines = out.close(status) if out.items or out.open else out.text("") + out.close(status)
                for line in lines:
                    yield line
                response = finished(meta, prompt, item, out.items)
                yield out.event(f"response.{response.status}", response=_json(response))
    except ApiError as e:  # the worker failed mid-answer: say so in the stream
        error = error_body(request.url.path, e)["error"]
        yield out.event("error", code=error["code"], message=error["message"], param=error["param"])
