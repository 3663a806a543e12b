"""The chat app: a conversation, coloured speculative tokens and live stats over one engine thread."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Button, Footer, Header, Input

from mlxspec.drafters import DRAFTERS
from mlxspec.pacing import AUTO

from .messages import (
    EngineInfo,
    EngineReady,
    GenerationDone,
    GenerationFailed,
    LoadFailed,
    LoadProgress,
    StatsSnapshot,
    StatsUpdated,
    TokensCommitted,
)
from .screens import DrafterChoice, DrafterScreen, HelpScreen
from .widgets import ChatLog, ChatMessage, Legend, LoadBar, StatsPanel
from .widgets.stats_panel import alpha_text, drafting, stats_drafting


class SpecChatApp(App):
    """Chat with a target model through speculative decoding.

    Args:
        engine: ``app.engine.Engine`` or anything with its methods (``start``, ``generate``,
            ``cancel``, ``configure``, ``close``); the tests pass a scripted fake.
        system: System prompt put before the conversation, or ``None``.
    """

    CSS_PATH = "app.tcss"
    TITLE = "mlxspec chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("f1", "help", "Keys"),
        Binding("question_mark", "help", "Keys", show=False),
        Binding("f2", "drafter", "Drafter"),
        Binding("f3", "toggle_plain", "Plain text"),
        Binding("f4", "toggle_vivid", "Colours"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("f9", "save_svg", "Screenshot", show=False),
        Binding("pageup", "scroll_chat(-1)", "Scroll up", show=False),
        Binding("pagedown", "scroll_chat(1)", "Scroll down", show=False),
    ]

    #: Screen classes by terminal width; app.tcss narrows and then hides the stats panel.
    HORIZONTAL_BREAKPOINTS = [(0, "-tiny"), (72, "-narrow"), (110, "-wide")]

    generating: reactive[bool] = reactive(False)
    """An answer is running: locks Enter (one answer at a time) and enables Stop."""
    plain: reactive[bool] = reactive(False)
    """Every message drawn without token colours (each message can still be toggled by a click)."""
    vivid: reactive[bool] = reactive(False)
    """Resampled tokens in full red instead of the calm underline (F4; ``mlxspec chat --vivid``)."""

    def __init__(self, engine, system: str | None = None, vivid: bool = False):
        super().__init__()
        self.engine = engine
        self.system = system
        self.set_reactive(SpecChatApp.vivid, vivid)
        self.history: list[dict] = []
        """Finished turns as ``role``/``content`` dicts (the system prompt is added when sending)."""
        self.info: EngineInfo | None = None
        self._request_id = 0
        self._answer: ChatMessage | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield LoadBar()
                yield ChatLog()
                yield Legend()
                with Horizontal(id="input-row"):
                    yield Input(placeholder="Message (Enter sends, Esc stops, F1 keys)", id="prompt")
                    yield Button("Stop", id="stop", variant="error", disabled=True)
            yield StatsPanel()
        yield Footer()

    def on_mount(self) -> None:
        self.set_class(self.vivid, "-vivid")
        self._stats_panel = self.query_one(StatsPanel)
        # the chat screen's widgets, kept: a dialog (F1, F2) on top hides them from query_one
        self._parts = {key: self.query_one(key) for key in (LoadBar, ChatLog, Legend, "#prompt", "#stop")}
        self._add_system()
        self._part("#prompt").focus()
        self.engine.start(self._post_from_engine)

    def on_unmount(self) -> None:
        self.engine.close()

    def _post_from_engine(self, message) -> None:
        """The engine's sink (called in the engine thread). Stats go straight to the panel so
        a newer ``StatsUpdated`` can replace a queued one."""
        target = self._stats_panel if isinstance(message, StatsUpdated) else self
        target.post_message(message)

    def _part(self, key):
        """A widget of the chat screen, found once (``on_mount`` finds them all while it is on top)."""
        parts = self.__dict__.setdefault("_parts", {})
        if key not in parts:
            parts[key] = self.query_one(key)
        return parts[key]

    @property
    def chat_log(self) -> ChatLog:
        return self._part(ChatLog)

    def conversation(self) -> list[dict]:
        """What the model sees: the system prompt (if any) and every turn."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    # Sending and stopping

    @on(Input.Submitted, "#prompt")
    def _on_submit(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.generating:
            self.notify("An answer is still running: Esc stops it.", severity="warning")
            return
        event.input.clear()
        for unsent in self.chat_log.query_children(".user.-failed"):
            if unsent.text == text:
                unsent.remove()  # sent again: the new message replaces the one marked not sent
        self.chat_log.add("user", text)
        self.history.append({"role": "user", "content": text})
        self._request_id += 1
        self._answer = self.chat_log.add("assistant")
        self._answer.plain = self.plain
        self._answer.add_class("-streaming")
        self._answer.border_subtitle = "working… (Esc stops)"
        self.generating = True
        self.engine.generate(self._request_id, self.conversation())

    @on(Button.Pressed, "#stop")
    def action_stop(self) -> None:
        if self.generating:
            self.engine.cancel(self._request_id)
            self._part("#stop").label = "Stopping…"
            if self._answer is not None:
                self._answer.border_subtitle = "stopping after this round…"
        self._part("#prompt").focus()

    def watch_generating(self, generating: bool) -> None:
        stop = self._part("#stop")
        stop.disabled, stop.label = not generating, "Stop"

    # Engine messages

    @on(TokensCommitted)
    def _on_tokens(self, message: TokensCommitted) -> None:
        if message.request_id == self._request_id and self._answer is not None:
            self._answer.append(message.spans)

    @on(GenerationDone)
    def _on_done(self, message: GenerationDone) -> None:
        if message.request_id != self._request_id:
            return
        self._stats_panel.finish(message.request_id, message.stats)
        if message.cancelled and self._answer is not None and not self._answer.text:
            # stopped before the first token: like a failed send, not an empty answer in the history
            self._finish_answer(failed=True)
            self.notify(f"Stopped before any answer: {self._unsend()}.", markup=False)
        elif self._answer is not None:
            self._answer.border_subtitle = summary(message.stats, message.cancelled, message.finish_reason)
            self._finish_answer()
        self.generating = False

    @on(GenerationFailed)
    def _on_failed(self, message: GenerationFailed) -> None:
        if message.request_id != self._request_id:
            return
        kept = self._answer is not None and self._answer.text
        self._finish_answer(failed=True)
        if not kept and self.history and self.history[-1]["role"] == "user":
            message.error += f" ({self._unsend()})"
        self.chat_log.add("error", f"Generation failed: {message.error}")
        self.generating = False

    def _unsend(self) -> str:
        """Take the unanswered last message out of the history (so it is never sent twice) and mark its
        bubble not sent; its text goes back into the input unless something is typed there. Sending the
        same text again replaces the marked bubble. Returns what happened, for the error message."""
        unsent = self.history.pop()
        question = next((m for m in reversed(self.chat_log.messages) if m.role == "user"), None)
        if question is not None:
            question.add_class("-failed")
            question.border_subtitle = "not sent"
        prompt = self._part("#prompt")
        if prompt.value:
            return "your message was not added to the conversation; it is marked not sent"
        prompt.value = unsent["content"]
        return "your message was not added to the conversation; it is back in the input: Enter sends it again"

    def _finish_answer(self, failed: bool = False) -> None:
        """Keep the answer (complete or partial) in the history; a failed (or stopped)
        empty one is dropped."""
        answer, self._answer = self._answer, None
        if answer is None:
            return
        answer.remove_class("-streaming")
        if answer.text or not failed:
            self.history.append({"role": "assistant", "content": answer.text})
        else:
            answer.remove()

    @on(LoadProgress)
    def _on_load_progress(self, message: LoadProgress) -> None:
        self._part(LoadBar).step(message.what, message.step, message.total)

    @on(LoadFailed)
    def _on_load_failed(self, message: LoadFailed) -> None:
        self._part(LoadBar).done()
        self.chat_log.add("error", message.error)
        if self.info is None:
            self._stats_panel.show_no_model()

    @on(EngineReady)
    def _on_ready(self, message: EngineReady) -> None:
        self._part(LoadBar).done()
        self.info = message.info
        self._stats_panel.show_info(message.info)
        self.sub_title = message.info.model_name
        info = message.info
        self.chat_log.add("info", f"Ready: {info.model_name}; drafter {info.drafter}, "
                                  f"{drafting(info.drafter, info.num_draft_tokens, info.shape)}")

    # Other actions

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_drafter(self) -> None:
        if self.info is None:
            info = EngineInfo("no model", False, None, "ngram", AUTO, DRAFTERS)
        else:
            info = self.info
        self.push_screen(DrafterScreen(info), self._switch)

    def _switch(self, choice: DrafterChoice | None) -> None:
        if choice is None:
            return
        self.engine.configure(choice.drafter, choice.num_draft_tokens, model=choice.model,
                              draft_model=choice.draft_model, dtype=choice.dtype,
                              draft_dtype=choice.draft_dtype)
        if self.generating:
            self.notify("The switch applies from the next answer.")

    def action_scroll_chat(self, pages: int) -> None:
        """Page through the history while typing (scrolling up stops following the answer)."""
        log = self.chat_log
        log.scroll_page_up() if pages < 0 else log.scroll_page_down()

    def action_toggle_plain(self) -> None:
        self.plain = not self.plain

    def watch_plain(self, plain: bool) -> None:
        for message in self.chat_log.messages:
            message.plain = plain

    def action_toggle_vivid(self) -> None:
        self.vivid = not self.vivid

    def watch_vivid(self, vivid: bool) -> None:
        """Swap the marks' styles (``app.tcss``: ``.-vivid``) and redraw what uses them."""
        self.set_class(vivid, "-vivid")
        for widget in (*self.chat_log.messages, self._part(Legend)):
            widget.refresh()

    def action_clear(self) -> None:
        """Forget the conversation (a running answer is stopped)."""
        if self.generating:
            self.engine.cancel(self._request_id)
            self._request_id += 1  # ignore what the stopped answer still sends
            self.generating = False
        self._answer = None
        self.history.clear()
        self.chat_log.clear()
        self._add_system()

    def action_save_svg(self) -> None:
        path = self.save_screenshot(path=str(Path.cwd()))
        self.notify(f"Saved {path}", markup=False)

    def _add_system(self) -> None:
        if self.system:
            self.chat_log.add("system", self.system)


def summary(stats: StatsSnapshot, cancelled: bool, finish_reason: str | None) -> str:
    """One line under a finished answer: τ, α, speed, drafter and what it drafted, and how it ended."""
    parts = [f"τ {stats.tau:.2f}", f"α {alpha_text(stats)}", f"{stats.tokens_per_s:.1f} tok/s"]
    if cancelled:
        parts.append("stopped")
    elif finish_reason == "length":
        parts.append("max tokens")
    # last: a long tree description is what the border cuts off
    return " · ".join([*parts, f"{stats.drafter} {stats_drafting(stats, now=False)}"])
