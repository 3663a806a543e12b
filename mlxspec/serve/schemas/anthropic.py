"""Anthropic's Messages bodies (``/v1/messages``, ``/v1/messages/count_tokens``).

Fields that change nothing here (``metadata``, a block's ``cache_control``...) are ignored; fields that
would change the answer but are not supported are refused with a 400 naming them (``unsupported``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .base import ApiModel, Reply, Speculative, Temperature, Text, omitted

# --- requests ------------------------------------------------------------------------------------


class TextBlock(ApiModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(ApiModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(ApiModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(ApiModel):
    """A turn: text, ``tool_use`` and ``tool_result`` blocks (no images). A last ``assistant`` turn is a
    prefill: the answer continues it."""

    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(ApiModel):
    name: Text
    description: str | None = None
    input_schema: dict = Field(description="JSON Schema of the input")


class MessagesRequest(ApiModel):
    """``POST /v1/messages``."""

    model: str = Field(description="the served model's name (GET /v1/models) or `default`")
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Text] | None = None
    temperature: Temperature | None = Field(None, le=1, description="0: greedy (default: serve's --temp)")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0: off")
    stream: bool = Field(False, description="answer as server-sent events")
    tools: list[AnthropicTool] | None = None
    tool_choice: dict | None = Field(None, description="{'type': 'auto'} (default) or {'type': 'none'}")

    def unsupported(self) -> tuple[str, str] | None:
        if self.tool_choice is not None and self.tool_choice.get("type") not in ("auto", "none"):
            return "tool_choice", (
                "tool_choice must be {'type': 'auto'} or {'type': 'none'} (a forced tool is not supported)"
            )
        return None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: int | None = Field(None, ge=1)


# --- responses -----------------------------------------------------------------------------------


class TextOut(Reply):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(Reply):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


class AnthropicUsage(Reply):
    input_tokens: int = Field(description="prompt tokens prefilled (not held by the prefix cache)")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="prompt tokens the prefix cache held")
    cache_creation_input_tokens: int = 0


class Message(Reply):
    """The answer of ``POST /v1/messages`` (streamed: in ``message_start``, then the block events)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage
    speculative: Speculative | None = omitted()


class TokenCount(Reply):
    """The answer of ``POST /v1/messages/count_tokens``."""

    input_tokens: int
