"""Switch drafter, its settings and γ without restarting; optionally load another model or dtype.

The dialog opens with the keyboard on the current drafter (arrows move, Space picks, Enter picks and
applies, as Enter does in every field) and shows the picked drafter's own settings, one field per
option of its options dataclass in the registry (the same options as its ``--<drafter>-<option>``
flags): tree, heads path, depth, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, RadioButton, RadioSet, Select

from mlxspec.drafters import DrafterSpec, drafter_types
from mlxspec.pacing import AUTO, MAX_NUM_DRAFT_TOKENS, SCHEDULED, check_num_draft_tokens
from mlxspec.loading.models import DTYPES

from ..messages import EngineInfo

#: The dtype choice that loads a model as stored (no cast).
AS_STORED = "as stored"
#: Drafters whose draft model's dtype is one of their settings: those that draft with a second model.
_DRAFT_DTYPE_DRAFTERS = tuple(name for name, kind in drafter_types().items() if kind.needs_draft_model)


@dataclass(frozen=True)
class DrafterChoice:
    """What the user picked.

    Attributes:
        drafter: The drafter with the settings typed in (a ``DrafterSpec``, plain data).
        num_draft_tokens: γ, an integer, ``"auto"`` or ``"scheduled"`` (as ``--num-draft-tokens``).
        draft_model, model: Specs to load; ``None`` keeps the loaded models.
        dtype, draft_dtype: A dtype to reload the target (draft model) in, ``AS_STORED``, or ``None``
            to keep it as it is.
    """

    drafter: DrafterSpec
    num_draft_tokens: int | str
    draft_model: str | None = None
    model: str | None = None
    dtype: str | None = None
    draft_dtype: str | None = None


class DrafterList(RadioSet):
    """The drafters: arrows move, Space picks (the dialog then shows the pick's settings), Enter picks
    and applies the dialog, as Enter does in its fields."""

    BINDINGS = [Binding("enter", "apply", "Apply", show=False)]

    @dataclass
    class Applied(Message):
        """Enter on ``drafter``."""

        drafter: str

    @property
    def highlighted(self) -> str | None:
        """The drafter under the keyboard highlight (what Space would pick)."""
        return self._nodes[self._selected].name if self._selected is not None else None

    def action_apply(self) -> None:
        name = self.highlighted
        self.action_toggle_button()
        if name is not None:
            self.post_message(self.Applied(name))


class DrafterScreen(ModalScreen[DrafterChoice | None]):
    """Radio buttons for the drafter, its settings, a γ field, the target's dtype and two model specs.

    Args:
        info: What the engine has loaded and uses now.
    """

    BINDINGS = [Binding("escape", "dismiss", "Cancel")]

    def __init__(self, info: EngineInfo):
        super().__init__()
        self.info = info
        self.kind = info.drafter if info.drafter in info.drafters else info.drafters[0]
        """The drafter whose settings are shown."""

    def compose(self) -> ComposeResult:
        info = self.info
        with Vertical(id="drafter-box"):
            yield Label("Drafter (↑/↓ move, Space picks, Enter applies)", classes="heading")
            with DrafterList(id="drafter-kind"):
                for kind in info.drafters:
                    label = (
                        kind
                        if kind not in _DRAFT_DTYPE_DRAFTERS or info.draft_name
                        else f"{kind} (give a draft model below)"
                    )
                    yield RadioButton(label, value=kind == self.kind, name=kind, id=f"drafter-{kind}")
            yield Label(
                f"γ, tokens drafted per round: 0 to {MAX_NUM_DRAFT_TOKENS} (0 = plain decoding), auto "
                "(picked each round) or scheduled (draft, medusa, eagle, dflash, dspark: the draft's "
                "confidence picks)",
                classes="caption",
            )
            yield Input(str(info.num_draft_tokens), id="gamma")
            yield Label("", id="options-heading", classes="caption", markup=False)
            yield Vertical(*self._option_rows(self.kind), id="drafter-options")
            yield Label("Target dtype (a change reloads the target)", classes="caption")
            yield Select(
                [(d, d) for d in (AS_STORED, *DTYPES)],
                value=info.dtype or AS_STORED,
                allow_blank=False,
                id="dtype",
            )
            yield Label(
                f"Load a draft model (empty keeps {info.draft_name or 'none'})",
                classes="caption",
                markup=False,
            )
            yield Input(placeholder="path, .gguf, Hugging Face repo or 'default'", id="draft-spec")
            yield Label("Load another target model (empty keeps the current one)", classes="caption")
            yield Input(placeholder="path, .gguf, Hugging Face repo or 'default'", id="model-spec")
            yield Label("", id="drafter-error", markup=False)
            with Horizontal(id="drafter-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        radio = self.query_one(RadioSet)
        radio.focus()
        # RadioSet highlights its first button on mount; the keyboard starts on the current drafter
        radio._selected = self.info.drafters.index(self.kind)
        self._caption()

    def _caption(self) -> None:
        fields = dataclasses.fields(drafter_types()[self.kind].options)
        text = (
            f"{self.kind} settings (empty = the default shown)"
            if fields or self.kind in _DRAFT_DTYPE_DRAFTERS
            else f"{self.kind} has no settings"
        )
        self.query_one("#options-heading", Label).update(text)

    def _option_rows(self, kind: str) -> list[Horizontal]:
        """One labelled field per option of ``kind``, holding its current value if it is the drafter in
        use."""
        current = dict(self.info.options) if kind == self.info.drafter else {}
        rows = []
        for f in dataclasses.fields(drafter_types()[kind].options):
            default = f.metadata["default_help"] or f.default
            field = Input(current.get(f.name, ""), placeholder=f"default: {default}", id=f"option-{f.name}",
                          compact=True)
            rows.append(
                Horizontal(
                    Label(f.name.replace("_", "-"), classes="option-name"), field, classes="option-row"
                )
            )
        if kind in _DRAFT_DTYPE_DRAFTERS:
            select = Select([(d, d) for d in (AS_STORED, *DTYPES)], value=self.info.draft_dtype or AS_STORED,
                            allow_blank=False, compact=True, id="draft-dtype")
            rows.append(Horizontal(Label("draft dtype", classes="option-name"), select, classes="option-row"))
        return rows

    @on(RadioSet.Changed)
    async def _show_options(self, event: RadioSet.Changed) -> None:
        kind = event.pressed.name
        box = self.query_one("#drafter-options", Vertical)
        await box.remove_children()
        await box.mount(*self._option_rows(kind))
        self.kind = kind
        self._caption()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#apply")
    @on(Input.Submitted)
    def _apply(self) -> None:
        self._close(self.choice())

    @on(DrafterList.Applied)
    def _apply_highlighted(self, event: DrafterList.Applied) -> None:
        self._close(self.choice(event.drafter))

    def _close(self, choice: DrafterChoice | str) -> None:
        """Dismiss with ``choice``, or show what to fix and stay open."""
        if isinstance(choice, str):
            self.query_one("#drafter-error", Label).update(choice)
        else:
            self.dismiss(choice)

    def choice(self, drafter: str | None = None) -> DrafterChoice | str:
        """The settings for ``drafter`` (default: the picked one), or an error message saying what to fix."""
        text = self.query_one("#gamma", Input).value.strip().lower()
        try:  # what --num-draft-tokens takes; whether the drafter can be scheduled is make_pacer's check
            gamma = text if text in (AUTO, SCHEDULED) else int(text)
            if isinstance(gamma, int):
                check_num_draft_tokens(gamma)  # the bound of --num-draft-tokens
        except ValueError:
            return f"γ must be 'auto', 'scheduled' or a whole number from 0 to {MAX_NUM_DRAFT_TOKENS}"
        pressed = self.query_one(RadioSet).pressed_button
        name = drafter or (pressed.name if pressed is not None else self.kind)
        shown = name == self.kind  # the settings on screen are this drafter's (not yet, right after a pick)
        spec = self._spec(name, shown)
        if isinstance(spec, str):
            return spec
        draft_spec = self.query_one("#draft-spec", Input).value.strip() or None
        model_spec = self.query_one("#model-spec", Input).value.strip() or None
        if name in _DRAFT_DTYPE_DRAFTERS and not (draft_spec or self.info.draft_name):
            return f"The {name} drafter needs a draft model: type one below, or start with --draft-model"
        dtype = self._changed("#dtype", self.info.dtype)
        draft_dtype = (
            self._changed("#draft-dtype", self.info.draft_dtype)
            if shown and name in _DRAFT_DTYPE_DRAFTERS
            else None
        )
        return DrafterChoice(spec, gamma, draft_spec, model_spec, dtype, draft_dtype)

    def _spec(self, name: str, shown: bool) -> DrafterSpec | str:
        """Drafter ``name`` with the typed settings (its defaults unless ``shown``), or what is wrong with
        one."""
        kind, values = drafter_types()[name], {}
        for f in dataclasses.fields(kind.options) if shown else ():
            text = self.query_one(f"#option-{f.name}", Input).value.strip()
            if not text:
                continue
            try:
                values[f.name] = f.metadata["parse"](text)
            except ValueError as e:
                return f"{name} {f.name.replace('_', '-')}: {e}"
        try:
            return DrafterSpec(name, kind.options(**values))
        except (ValueError, FileNotFoundError) as e:
            return f"{name}: {e}"

    def _changed(self, selector: str, loaded: str | None) -> str | None:
        """The dtype picked in ``selector`` if it differs from the one ``loaded`` (``None`` = unchanged)."""
        value = self.query_one(selector, Select).value
        return None if value == (loaded or AS_STORED) else value
