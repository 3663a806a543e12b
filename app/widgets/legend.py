"""What the answer's token marks mean."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from .chat_message import KIND_CLASSES

LABELS = (
    ("accepted", "accepted draft"),
    ("resampled", "resampled (not an error)"),
    ("bonus", "bonus / target"),
)


class Legend(Widget):
    """One line naming each token mark, each label drawn in its mark (the component styles of
    ``ChatMessage``), and the key that swaps the calm marks for full colour."""

    COMPONENT_CLASSES = set(KIND_CLASSES.values())

    def render(self) -> Text:
        text = Text(end="")
        for i, (kind, label) in enumerate(LABELS):
            if i:
                text.append(" · ")
            text.append(label, self.get_component_rich_style(KIND_CLASSES[kind], partial=True))
        text.append("   F4: red")
        return text
