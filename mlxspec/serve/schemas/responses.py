"""OpenAI's Responses API bodies (``POST /v1/responses``), stateless.

Input items: messages (text parts), ``function_call`` and ``function_call_output``; function tools.
Asking the server to keep state (``store: true``, ``previous_response_id``, ``conversation``,
``background``) or to change the answer in ways it cannot (a forced tool, structured output, logprobs)
is refused with a 400 naming the field (``unsupported``); fields that change nothing here (``metadata``,
``reasoning``, ``include``, ``parallel_tool_calls``, ``truncation``...) are ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from .base import ApiModel, Reply, Speculative, Temperature, Text, omitted

# --- requests ------------------------------------------------------------------------------------


class InputText(ApiModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(ApiModel):
    """A message: text, or ``input_text`` / ``output_text`` parts (no images or files)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallInput(ApiModel):
    """A call the model made earlier (sent back with its output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="a JSON object, in text")


class FunctionCallOutput(ApiModel):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


def _item_type(item) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return f"{kind} item" if kind in ("message", "function_call", "function_call_output") else None


#: An input item, told apart by ``type`` (a message may leave it out); the tags are no field names.
InputItem = Annotated[
    Annotated[InputMessage, Tag("message item")] | Annotated[FunctionCallInput, Tag("function_call item")]
    | Annotated[FunctionCallOutput, Tag("function_call_output item")],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message="each input item must be a message, a function_call or a "
                                       "function_call_output (no images, files or built-in tools)"),
]


class FunctionTool(ApiModel):
    type: Literal["function"]
    name: Text
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON Schema of the arguments")
    strict: bool | None = None


class ResponsesRequest(ApiModel):
    """``POST /v1/responses``."""

    model: str = Field(description="the served model's name (GET /v1/models) or `default`")
    input: Text | list[InputItem] = Field(description="the user's text, or the conversation's items")
    instructions: str | None = Field(None, description="a system message put first")
    max_output_tokens: int | None = Field(None, ge=1, description="most tokens to generate")
    temperature: Temperature | None = Field(None, le=2, description="0: greedy (default: serve's --temp)")
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, description="function tools (no built-in tools)")
    tool_choice: str | dict | None = Field(None, description="`auto` (default) or `none`")
    stream: bool = Field(False, description="answer as server-sent `response.*` events")
    store: bool | None = Field(None, description="must be false or left out: no response is kept")
    previous_response_id: str | None = Field(None, description="not supported (stateless): send the items")
    conversation: str | dict | None = Field(None, description="not supported (stateless)")
    background: bool | None = Field(None, description="must be false")
    text: dict | None = Field(None, description="only {'format': {'type': 'text'}}")
    top_logprobs: int | None = Field(None, description="not supported")

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for a field that is valid but cannot be honoured here, else ``None``."""
        if self.store:
            return "store", "store: true is not supported: this server keeps no responses; send store: false"
        if self.previous_response_id is not None:
            return "previous_response_id", ("previous_response_id is not supported: this server keeps no "
                                            "responses; send the conversation's items in input")
        if self.conversation is not None:
            return "conversation", "conversation is not supported: this server keeps no state; send the items"
        if self.background:
            return "background", "background responses are not supported; leave background out"
        if isinstance(self.tool_choice, dict) or self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", "tool_choice must be 'auto' or 'none' (a forced tool call is not supported)"
        if self.text is not None and (self.text.get("format") or {}).get("type", "text") != "text":
            return "text.format", "text.format must be {'type': 'text'} (structured output is not supported)"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not supported; leave it out"
        return None


# --- responses -----------------------------------------------------------------------------------


class OutputText(Reply):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []


class OutputMessage(Reply):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(Reply):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="a JSON object, in text")
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(Reply):
    cached_tokens: int = Field(description="prompt tokens the prefix cache held")
    cache_write_tokens: int = 0


class OutputTokensDetails(Reply):
    reasoning_tokens: int = 0


class ResponseUsage(Reply):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(Reply):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class Response(Reply):
    """The answer of ``POST /v1/responses`` (streamed: in ``response.created``, ``response.completed`` or
    ``response.incomplete``)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage | FunctionCallItem]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = []
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    store: bool = False
    text: dict = {"format": {"type": "text"}}
    metadata: dict = {}
    usage: ResponseUsage | None = omitted()
    speculative: Speculative | None = omitted()
