"""Request bodies of the OpenAI and Anthropic APIs as pydantic models (validated strictly from JSON).

Fields a client commonly sends but that change nothing here (``user``, ``metadata``,
``parallel_tool_calls``, a block's ``cache_control``...) are ignored; fields that would change the
answer but are not supported are refused by the routes with a 400 naming them (``unsupported``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Text = Annotated[str, Field(min_length=1)]


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# --- OpenAI --------------------------------------------------------------------------------------

class TextPart(ApiModel):
    type: Literal["text"]
    text: str


class FunctionCall(ApiModel):
    name: str
    arguments: str


class ToolCall(ApiModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(ApiModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(ApiModel):
    name: Text
    description: str | None = None
    parameters: dict | None = None


class Tool(ApiModel):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(ApiModel):
    include_usage: bool = False


class Sampling(ApiModel):
    """What both OpenAI endpoints take besides the prompt."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def stops(self) -> list[str]:
        """``stop`` as a list (OpenAI takes one string or several)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for a field that is valid but cannot be honoured here, else ``None``."""
        if self.n != 1:
            return "n", "n must be 1: one choice is generated per request"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported (the output follows the target exactly); leave it out or 0"
        return None


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs is not supported; leave it out or false"
        if self.top_logprobs is not None:
            return "top_logprobs", "top_logprobs is not supported (no logprobs are returned); leave it out"
        if isinstance(self.tool_choice, dict) or self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", "tool_choice must be 'auto' or 'none' (a forced tool call is not supported)"
        return super().unsupported()


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]  # token ids outside the vocabulary are refused naming the id
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int = Field(1, ge=1)

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs is not None:
            return "logprobs", "logprobs is not supported; leave it out"
        if self.echo:
            return "echo", "echo is not supported; leave it out or false"
        if self.suffix:
            return "suffix", "suffix (fill-in-the-middle) is not supported; leave it out"
        if self.best_of != 1:
            return "best_of", "best_of must be 1: one choice is generated per request"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            return "prompt", "one prompt per request: give a string (or a list of one)"
        return super().unsupported()


# --- Anthropic -----------------------------------------------------------------------------------

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
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(ApiModel):
    name: Text
    description: str | None = None
    input_schema: dict


class MessagesRequest(ApiModel):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tool_choice is not None and self.tool_choice.get("type") not in ("auto", "none"):
            return "tool_choice", "tool_choice must be {'type': 'auto'} or {'type': 'none'} (a forced tool is not supported)"
        return None


class CountTokensRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: int | None = Field(None, ge=1)
