"""Switch drafter and γ without restarting; optionally load another draft or target model."""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, RadioButton, RadioSet

from ..messages import EngineInfo

MAX_DRAFT_TOKENS = 32


@dataclass(frozen=True)
class DrafterChoice:
    """What the user picked; ``None`` model specs keep the loaded models."""

    drafter: str
    num_draft_tokens: int | str
    draft_model: str | None = None
    model: str | None = None


class DrafterScreen(ModalScreen[DrafterChoice | None]):
    """Radio buttons for the drafter, a γ field and two optional model specs.

    Args:
        info: What the engine has loaded and uses now.
    """

    BINDINGS = [Binding("escape", "dismiss", "Cancel")]

    def __init__(self, info: EngineInfo):
        super().__init__()
        self.info = info

    def compose(self) -> ComposeResult:
        info = self.info
        with Vertical(id="drafter-box"):
            yield Label("Drafter", classes="heading")
            with RadioSet(id="drafter-kind"):
                for kind in info.drafters:
                    label = kind if kind != "draft" or info.draft_name else "draft (give a draft model below)"
                    yield RadioButton(label, value=kind == info.drafter, name=kind, id=f"drafter-{kind}")
            yield Label("γ, tokens drafted per round (0 = plain decoding; auto = picked each round)",
                        classes="caption")
            yield Input(str(info.num_draft_tokens), id="gamma")
            yield Label(f"Load a draft model (empty keeps {info.draft_name or 'none'})", classes="caption", markup=False)
            yield Input(placeholder="path, .gguf, Hugging Face repo or 'default'", id="draft-spec")
            yield Label("Load another target model (empty keeps the current one)", classes="caption")
            yield Input(placeholder="path, .gguf, Hugging Face repo or 'default'", id="model-spec")
            yield Label("", id="drafter-error", markup=False)
            with Horizontal(id="drafter-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#apply")
    @on(Input.Submitted)
    def _apply(self) -> None:
        choice = self.choice()
        if isinstance(choice, str):
            self.query_one("#drafter-error", Label).update(choice)
        else:
            self.dismiss(choice)

    def choice(self) -> DrafterChoice | str:
        """The picked settings, or an error message saying what to fix."""
        pressed = self.query_one(RadioSet).pressed_button
        kind = pressed.name if pressed is not None else self.info.drafter
        text = self.query_one("#gamma", Input).value.strip().lower()
        try:
            gamma = text if text == "auto" else int(text)
        except ValueError:
            gamma = -1
        if gamma != "auto" and not 0 <= gamma <= MAX_DRAFT_TOKENS:
            return f"γ must be 'auto' or a whole number from 0 to {MAX_DRAFT_TOKENS}"
        draft_spec = self.query_one("#draft-spec", Input).value.strip() or None
        model_spec = self.query_one("#model-spec", Input).value.strip() or None
        if kind == "draft" and not (draft_spec or self.info.draft_name):
            return "The draft drafter needs a draft model: type one above, or start with --draft-model"
        return DrafterChoice(kind, gamma, draft_spec, model_spec)
