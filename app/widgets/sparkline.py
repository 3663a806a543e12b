"""A one-line bar chart of τ per round on a fixed 1..γ+1 scale (Textual's Sparkline rescales)."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


def bars(values: tuple[int, ...], top: int) -> str:
    """One block character per value, ``1`` → lowest bar and ``top`` → full bar."""
    if top <= 1:
        return BARS[0] * len(values)
    steps = len(BARS) - 1
    return "".join(BARS[round((min(v, top) - 1) / (top - 1) * steps)] for v in values)


class TauSparkline(Widget):
    """The newest rounds that fit the width, oldest on the left."""

    values: reactive[tuple[int, ...]] = reactive(tuple)
    """τ of each recent round (accepted + 1)."""
    top: reactive[int] = reactive(1)
    """The full-bar value, γ + 1."""

    def render(self) -> str:
        width = max(self.size.width, 1)
        return bars(self.values[-width:], max(self.top, *self.values[-width:], 1)) or " "
