"""OpenAI's chat completions, completions and models bodies.

Fields a client commonly sends but that change nothing here (``user``, ``metadata``,
``parallel_tool_calls``...) are ignored; fields that would change the answer but are not supported
are refused by the routes with a 400 naming them (``unsupported``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import ApiModel, Reply, Speculative, Temperature, Text, omitted

# --- requests ------------------------------------------------------------------------------------


class TextPart(ApiModel):
    type: Literal["text"]
    text: str


class FunctionCall(ApiModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in text")


class ToolCall(ApiModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(ApiModel):
    """A message of the conversation: text or text parts (no images)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(ApiModel):
    name: Text
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON Schema of the arguments")


class Tool(ApiModel):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(ApiModel):
    include_usage: bool = False


class Sampling(ApiModel):
    """What both OpenAI endpoints take besides the prompt."""

    model: str = Field(description="the served model's name (GET /v1/models) or `default`")
    max_tokens: int | None = Field(
        None, ge=1, description="most tokens to generate (default: serve's --max-tokens)"
    )
    temperature: Temperature | None = Field(None, le=2, description="0: greedy (default: serve's --temp)")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0: off")
    min_p: float | None = Field(None, ge=0, lt=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Text | list[Text] | None = Field(None, description="one stop string or several")
    stream: bool = Field(False, description="answer as server-sent events")
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, description="must be 1")
    presence_penalty: float = Field(0.0, description="must be 0")
    frequency_penalty: float = Field(0.0, description="must be 0")

    def stops(self) -> list[str]:
        """``stop`` as a list (OpenAI takes one string or several)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for a field that is valid but cannot be honoured here, else ``None``."""
        if self.n != 1:
            return "n", "n must be 1: one choice is generated per request"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return (
                    name,
                    f"{name} is not supported (the output follows the target exactly); leave it out or 0",
                )
        return None


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the same as max_tokens")
    tools: list[Tool] | None = Field(
        None, description="function tools, rendered by the model's chat template"
    )
    tool_choice: str | dict | None = Field(None, description="`auto` (default) or `none`")
    logprobs: bool | None = Field(None, description="must be false")
    top_logprobs: int | None = Field(None, description="not supported")

    def unsupported(self) -> tuple[str, str] | None:
        given = (self.max_tokens, self.max_completion_tokens)
        if None not in given and given[0] != given[1]:
            return "max_completion_tokens", (
                f"max_tokens ({given[0]}) and max_completion_tokens ({given[1]}) differ; send one of them"
            )
        if self.logprobs:
            return "logprobs", "logprobs is not supported; leave it out or false"
        if self.top_logprobs is not None:
            return "top_logprobs", "top_logprobs is not supported (no logprobs are returned); leave it out"
        if isinstance(self.tool_choice, dict) or self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", "tool_choice must be 'auto' or 'none' (a forced tool call is not supported)"
        return super().unsupported()


class CompletionRequest(Sampling):
    """``POST /v1/completions``: a prompt without the chat template."""

    prompt: str | list[int] | list[str] = Field(description="text, a list of one text, or token ids")
    logprobs: int | None = Field(None, description="not supported")
    echo: bool = Field(False, description="must be false")
    suffix: str | None = Field(None, description="not supported")
    best_of: int = Field(1, ge=1, description="must be 1")

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs is not None:
            return "logprobs", "logprobs is not supported; leave it out"
        if self.echo:
            return "echo", "echo is not supported; leave it out or false"
        if self.suffix:
            return "suffix", "suffix (fill-in-the-middle) is not supported; leave it out"
        if self.best_of != 1:
            return "best_of", "best_of must be 1: one choice is generated per request"
        if (
            isinstance(self.prompt, list)
            and self.prompt
            and isinstance(self.prompt[0], str)
            and len(self.prompt) != 1
        ):
            return "prompt", "one prompt per request: give a string (or a list of one)"
        return super().unsupported()


# --- responses -----------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]


class CalledFunction(Reply):
    name: str
    arguments: str = Field(description="a JSON object, in text")


class CalledTool(Reply):
    index: int | None = omitted()  # streamed calls only
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(Reply):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[CalledTool] | None = omitted()


class ChatChoice(Reply):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class PromptTokensDetails(Reply):
    cached_tokens: int = Field(description="prompt tokens the prefix cache held")


class Usage(Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(Reply):
    """The answer of ``POST /v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: Speculative


class ChunkDelta(Reply):
    role: Literal["assistant"] | None = omitted()
    content: str | None = omitted()
    tool_calls: list[CalledTool] | None = omitted()


class ChunkChoice(Reply):
    index: int = 0
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(Reply):
    """One streamed event of ``POST /v1/chat/completions``; the one with the ``finish_reason`` (and the
    usage chunk) carries ``speculative``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = omitted()
    speculative: Speculative | None = omitted()


class CompletionChoice(Reply):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(Reply):
    """The answer of ``POST /v1/completions``, and each of its streamed events."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = omitted()
    speculative: Speculative | None = omitted()


class ModelCard(Reply):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "mlxspec"


class ModelList(Reply):
    """``GET /v1/models``: the one model served."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
