"""The list of keys (F1 or ``?``)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static

KEYS = (
    ("Enter", "send the message"),
    ("Esc", "stop the running answer (keeps what it wrote; before any, the message goes back into the "
            "input)"),
    ("F2", "switch drafter and its settings, γ, dtype, draft or target model"),
    ("F3", "plain text on/off (click a message to toggle it alone)"),
    ("F4", "resampled tokens in red instead of underlined"),
    ("PgUp/PgDn", "scroll the conversation (the end follows the answer again)"),
    ("Ctrl+L", "clear the conversation"),
    ("F9", "save an SVG screenshot in the current folder"),
    ("F1 / ?", "this list"),
    ("Ctrl+Q", "quit"),
)


class HelpScreen(ModalScreen[None]):
    """Lists the keys; any of Esc, F1, ``?`` or q closes it."""

    BINDINGS = [Binding("escape,f1,question_mark,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Label("Keys", classes="heading")
            yield Static("\n".join(f"{key:<10} {what}" for key, what in KEYS), id="help-keys")
            yield Static("Marks: green = a draft token the target accepted; underlined (red with F4) = "
                         "resampled: the drafter guessed wrong there and the target chose this token itself "
                         "(exactly as it would have without drafting, so not an error); plain = bonus or "
                         "target token. Many marks mean low acceptance, not wrong text.", id="help-colours")
            yield Label("Esc closes this list.", classes="caption")
