"""The scrolling history of the conversation."""

from __future__ import annotations

from textual.containers import VerticalScroll

from .chat_message import ChatMessage


class ChatLog(VerticalScroll):
    """Holds ``ChatMessage`` widgets and stays scrolled to the newest unless the user scrolls up."""

    def on_mount(self) -> None:
        self.anchor()

    def add(self, role: str, text: str = "") -> ChatMessage:
        """Append a message and return it."""
        message = ChatMessage(role, text)
        self.mount(message)
        return message

    @property
    def messages(self) -> list[ChatMessage]:
        return list(self.query_children(ChatMessage))

    def clear(self) -> None:
        """Remove every message."""
        self.remove_children()
