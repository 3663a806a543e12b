"""Model loading progress, shown above the chat while the engine loads."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar


class LoadBar(Horizontal):
    """A label naming the step (k/n) and a pulsing bar (``load`` reports no finer progress);
    hidden (CSS class ``-idle``) when nothing loads."""

    def compose(self) -> ComposeResult:
        yield Label("Starting the engine…", id="load-label", markup=False)
        yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="load-progress")

    def step(self, what: str, step: int, total: int) -> None:
        """Show loading step ``step`` of ``total`` (from 1)."""
        self.remove_class("-idle")
        self.query_one(Label).update(f"{what}  ({step}/{total})")

    def done(self) -> None:
        self.add_class("-idle")
