"""Tool calls in generated text, found as the text streams.

Two forms:

- **The template's own**, parsed by mlx-lm's tool parsers (``mlx_lm.tool_parsers``): the format is the one
  mlx-lm's tokenizer loader infers from the chat template or vocabulary (``<tool_call>{json}</tool_call>``
  of Qwen2.5 and Hermes-style templates, Qwen3-Coder's ``<function=...>``, Mistral's ``[TOOL_CALLS]``,
  Gemma, GLM, Kimi, MiniMax, LFM's pythonic calls...); a template that writes ``<tool_call>`` blocks but
  names no known format gets the JSON form.
- **A fenced JSON block** (```` ```json {"name": ..., "arguments": {...}} ``` ````) that is a valid call to a
  tool the request offered: what small models (Qwen2.5-Coder-1.5B) answer instead of their template's form.

The parser holds back text that may start a call until it knows, so a streamed answer never shows part of
one; a block that does not parse as a call is passed on as text.
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

FENCE = "```"


@dataclass(frozen=True)
class ToolCall:
    """One call: ``arguments`` is a JSON object as text (OpenAI's form); ``input`` the same, parsed."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def input(self) -> dict:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool-call markup: text between ``start`` and ``end`` (``""``: the end of the answer) is
    parsed by ``parse(text, tools)``, an mlx-lm parser returning ``{"name", "arguments"}`` or a list of
    them."""

    name: str
    start: str
    end: str
    parse: Callable


def tool_format(tokenizer) -> ToolFormat | None:
    """The tool-call format of ``tokenizer``'s model, as mlx-lm infers it, or ``None``.

    mlx-lm's loader sets ``tool_parser_type`` on the tokenizers it loads; a GGUF's tokenizer is built by
    mlxspec, so the same inference (``mlx_lm.tokenizer_utils._infer_tool_parser``) runs on it here.
    """
    name = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type")
    if name is None:
        try:
            from mlx_lm.tokenizer_utils import _infer_tool_parser

            name = _infer_tool_parser(tokenizer)
        except Exception:  # an mlx-lm without it, or a tokenizer it cannot read: the JSON form below
            name = None
    template = getattr(tokenizer, "chat_template", None)
    if name is None and isinstance(template, str) and "<tool_call>" in template:
        name = "json_tools"
    if name is None:
        return None
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolFormat(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def as_call(data, names: set[str] | None = None) -> ToolCall | None:
    """``{"name": str, "arguments": object or its JSON text}`` as a ``ToolCall`` (``parameters`` is taken
    for ``arguments``); ``None`` if it is not one, or names no tool of ``names`` (when given)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    if names is not None and data["name"] not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    call = ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))
    return ToolCall(call.name, call.arguments, data["id"]) if isinstance(data.get("id"), str) else call


def _calls(parsed, names: set[str] | None = None) -> list[ToolCall] | None:
    """A parser's result (one call or a list) as ``ToolCall``s, or ``None`` unless every one is a call."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = [as_call(item, names) for item in items]
    return calls if calls and all(c is not None for c in calls) else None


class ToolCallParser:
    """Split streamed text into plain text and ``ToolCall``s.

    Args:
        fmt: The model's format (``tool_format``), or ``None``.
        tools: The request's tools as OpenAI function tools (their names admit a fenced JSON call).

    ``feed(text)`` and ``finish()`` return a list of pieces, each a ``str`` (text to show) or a ``ToolCall``.
    """

    def __init__(self, fmt: ToolFormat | None, tools: list[dict]):
        self.fmt, self.tools = fmt, tools
        self.names = {t["function"]["name"] for t in tools}
        self._buffer, self._mode = "", "text"  # text | call | fence (undecided) | code (a fence, not a call)

    def feed(self, text: str) -> list:
        self._buffer += text
        out = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list:
        """What is left at the end: an unclosed call is a call if it parses, else text."""
        rest, mode = self._buffer, self._mode
        self._buffer, self._mode = "", "text"
        if mode == "call":
            return self._template_calls(rest) or [self.fmt.start + rest]
        if mode == "fence":
            return self._fenced(rest.partition("\n")[2]) or [FENCE + rest]
        return [rest] if rest else []

    def _step(self, out: list) -> bool:
        """Consume what can be decided of the buffer; whether to look again."""
        b = self._buffer
        if self._mode == "text":
            markers = [FENCE] + ([self.fmt.start] if self.fmt and self.fmt.start else [])
            found = [(b.find(m), m) for m in markers if m in b]
            if not found:
                keep = max(_partial(b, m) for m in markers)
                self._emit(out, len(b) - keep)
                return False
            at, marker = min(found)
            self._emit(out, at)
            self._buffer = self._buffer[len(marker) :]
            self._mode = "fence" if marker == FENCE else "call"
            return True
        if self._mode == "call":
            end = b.find(self.fmt.end) if self.fmt.end else -1
            if end < 0:
                return False
            body, self._buffer, self._mode = b[:end], b[end + len(self.fmt.end) :], "text"
            out.extend(self._template_calls(body) or [self.fmt.start + body + self.fmt.end])
            return True
        if self._mode == "code":  # pass a fenced block that is not a call through to its closing fence
            close = b.find(FENCE)
            if close < 0:
                self._emit(out, len(b) - _partial(b, FENCE))
                return False
            self._emit(out, close + len(FENCE))
            self._mode = "text"
            return True
        return self._fence(out, b)

    def _fence(self, out: list, b: str) -> bool:
        """After an opening fence: hold a ```json block starting with ``{`` or ``[`` until it closes."""
        info, newline, content = b.partition("\n")
        start = content.lstrip()[:1]
        if not newline or (not start and FENCE not in content):
            if FENCE in info:  # ``` inline ```: not a block
                out.append(FENCE)
                self._mode = "text"
                return True
            return False
        if info.strip() not in ("", "json") or start not in "{[":
            out.append(FENCE)
            self._mode = "code"
            return True
        close = content.find(FENCE)
        if close < 0:
            return False
        body, self._buffer, self._mode = content[:close], content[close + len(FENCE) :], "text"
        out.extend(self._fenced(body) or [FENCE + info + "\n" + body + FENCE])
        return True

    def _emit(self, out: list, n: int) -> None:
        if n > 0:
            out.append(self._buffer[:n])
            self._buffer = self._buffer[n:]

    def _template_calls(self, body: str) -> list[ToolCall] | None:
        try:
            return _calls(self.fmt.parse(body, self.tools))
        except Exception:  # each parser raises its own errors on text that is not a call
            return None

    def _fenced(self, body: str) -> list[ToolCall] | None:
        try:
            return _calls(json.loads(body), self.names)
        except ValueError:
            return None


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (without being all of it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split(text: str, fmt: ToolFormat | None, tools: list[dict]) -> tuple[str, list[ToolCall]]:
    """A whole answer's text (tool calls removed) and its calls."""
    parser = ToolCallParser(fmt, tools)
    pieces = parser.feed(text) + parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]
