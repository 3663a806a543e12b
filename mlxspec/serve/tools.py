"""Tool calls in generated text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
(the format of Qwen2.5's and Hermes-style chat templates), found as the text streams.

The parser holds back text that may be the start of ``<tool_call>`` until it knows, so a streamed
answer never shows part of the tag; a block whose JSON does not parse is passed on as text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call: ``arguments`` is a JSON object as text (OpenAI's form); ``input`` the same, parsed."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def input(self) -> dict:
        return json.loads(self.arguments)


def parse_call(body: str) -> ToolCall | None:
    """The call in a block's JSON body, or ``None`` if it is not ``{"name": str, "arguments": object}``."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Split streamed text into plain text and ``ToolCall``s.

    ``feed(text)`` and ``finish()`` return a list of pieces, each a ``str`` (text to show) or a ``ToolCall``.
    """

    def __init__(self):
        self._buffer, self._inside = "", False

    def feed(self, text: str) -> list:
        self._buffer += text
        out = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return out
                body, self._buffer, self._inside = self._buffer[:end], self._buffer[end + len(CLOSE):], False
                call = parse_call(body)
                out.append(call if call is not None else OPEN + body + CLOSE)
            else:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _partial_tag(self._buffer)
                    if len(self._buffer) > keep:
                        out.append(self._buffer[: len(self._buffer) - keep])
                        self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                if start:
                    out.append(self._buffer[:start])
                self._buffer, self._inside = self._buffer[start + len(OPEN):], True

    def finish(self) -> list:
        """What is left at the end: an unclosed block is a call if its JSON parses, else text."""
        rest, inside = self._buffer, self._inside
        self._buffer, self._inside = "", False
        if not rest and not inside:
            return []
        if inside:
            call = parse_call(rest)
            return [call] if call is not None else [OPEN + rest]
        return [rest]


def _partial_tag(text: str) -> int:
    """Length of the longest end of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def split(text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer's text (tool-call blocks removed) and its calls."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]
