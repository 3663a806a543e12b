"""What the answer colours mean."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from .chat_message import KIND_CLASSES

LABELS = (
    ("accepted", "accepted draft"),
    ("resampled", "resampled (draft rejected)"),
    ("bonus", "bonus / target"),
)


class Legend(Widget):
    """One line naming each token colour, drawn with the same component styles as ``ChatMessage``."""

    COMPONENT_CLASSES = set(KIND_CLASSES.values())

    def render(self) -> Text:
        text = Text(end="")
        for i, (kind, label) in enumerate(LABELS):
            if i:
                text.append("   ")
            style = self.get_component_rich_style(KIND_CLASSES[kind], partial=True)
            text.append("■ " + label, style)
        return text
