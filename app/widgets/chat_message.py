"""One turn of the conversation; an answer keeps each token's origin so it can be coloured."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

#: Component class per token kind; ``app.tcss`` gives each its mark (colour or underline).
KIND_CLASSES = {
    "accepted": "chat-message--accepted",
    "resampled": "chat-message--resampled",
    "bonus": "chat-message--bonus",
    "target": "chat-message--target",
}


class ChatMessage(Widget):
    """A user, assistant, system or error message.

    Assistant text is held as ``(text, kind)`` spans, one per committed token with text, and drawn
    with the style of the kind's component class (accepted green, resampled underlined, or red on the
    app's ``-vivid`` class, the others plain).
    Clicking the message toggles plain text for it alone.

    Args:
        role: ``"user"``, ``"assistant"``, ``"system"``, ``"info"`` or ``"error"``; also a CSS class.
        text: Initial text (one plain span).
    """

    COMPONENT_CLASSES = set(KIND_CLASSES.values())
    ALLOW_SELECT = True

    plain: reactive[bool] = reactive(False)
    """Draw without token colours (for copying); the spans keep their kinds."""

    def __init__(self, role: str, text: str = "", **kwargs):
        super().__init__(classes=role, **kwargs)
        self.role = role
        self.spans: list[tuple[str, str]] = [(text, "plain")] if text else []
        self.border_title = role

    @property
    def text(self) -> str:
        """The message text without styles."""
        return "".join(text for text, _ in self.spans)

    def append(self, spans: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> None:
        """Add committed tokens as ``(text, kind)`` pairs."""
        self.spans.extend(spans)
        self.refresh(layout=True)

    def styled_text(self) -> Text:
        """The text with one span per token, styled by kind unless ``plain``."""
        text = Text(end="")
        for chunk, kind in self.spans:
            name = KIND_CLASSES.get(kind)
            if self.plain or name is None:
                text.append(chunk)
            else:
                text.append(chunk, self.get_component_rich_style(name, partial=True))
        return text

    def render(self) -> Text:
        return self.styled_text()

    def watch_plain(self) -> None:
        self.refresh()

    def on_click(self) -> None:
        self.plain = not self.plain
