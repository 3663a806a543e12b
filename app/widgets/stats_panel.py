"""Live speculation stats: τ, α, a τ sparkline, speed, time split, drafter and models."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Static

from mlxspec.drafters import drafter_types

from ..messages import EngineInfo, StatsSnapshot, StatsUpdated
from .sparkline import TauSparkline


class StatsPanel(Vertical):
    """Updated in place every round (labels change, nothing is remounted, so nothing flickers).

    The engine posts ``StatsUpdated`` straight to this widget, so a newer one replaces a queued one.
    """

    _finished = -1  # id of the last answer whose final totals are shown; later running stats are stale

    def compose(self) -> ComposeResult:
        yield Label("Speculation", classes="heading")
        yield Static("τ  –", id="tau", markup=False)
        yield Static("α  –", id="alpha", markup=False)
        yield Label("τ per round", classes="caption")
        yield TauSparkline(id="sparkline")
        yield Static("", id="speed", markup=False)
        yield Static("", id="timing", markup=False)
        yield Label("Drafter", classes="heading")
        yield Static("–", id="drafter", markup=False)
        yield Label("Target model", classes="heading")
        yield Static("loading…", id="target", markup=False)
        yield Label("Draft model", classes="heading")
        yield Static("none loaded", id="draft", markup=False)

    @on(StatsUpdated)
    def _stats_updated(self, message: StatsUpdated) -> None:
        message.stop()
        if message.request_id > self._finished:
            self.show_stats(message.stats)

    def finish(self, request_id: int, stats: StatsSnapshot) -> None:
        """Show an answer's final totals; its running stats still queued are then ignored."""
        self._finished = request_id
        self.show_stats(stats)

    def show_stats(self, stats: StatsSnapshot) -> None:
        """Show one answer's running totals."""
        last = f"   this round {stats.tau_round}" if stats.rounds else ""
        self._set("#tau", f"τ  {stats.tau:.2f}{last}")
        self._set("#alpha", f"α  {alpha_text(stats)}" + ("" if stats.drafted else " (nothing drafted)"))
        spark = self.query_one(TauSparkline)
        spark.top, spark.values = stats.num_draft_tokens + 1, stats.taus
        self._set(
            "#speed", f"{stats.tokens_per_s:.1f} tokens/s\n{stats.tokens} tokens in {stats.rounds} rounds"
        )
        self._set("#timing", f"draft  {stats.draft_s:.2f} s\nverify {stats.verify_s:.2f} s")
        self._set("#drafter", f"{stats.drafter}   {stats_drafting(stats)}")

    def show_info(self, info: EngineInfo) -> None:
        """Show what is loaded and the drafter that the next answer will use."""
        self._set("#drafter", f"{info.drafter}   {drafting(info.drafter, info.num_draft_tokens, info.shape)}")
        self._set("#target", f"{info.model_name}\nquantized: {'yes' if info.quantized else 'no'}")
        self._set("#draft", info.draft_name or "none loaded")

    def show_no_model(self) -> None:
        """No target is loaded (a failed start-up load): say how to load one."""
        self._set("#target", "none loaded (F2 loads one)")

    def _set(self, selector: str, text: str) -> None:
        self.query_one(selector, Static).update(text)


def drafting(drafter: str, gamma: int | str, shape: str | None = None, detail: str = "") -> str:
    """What each round drafts, as the panel, an answer's summary and the Ready line say it: a tree
    drafter's tree (``pacing.tree_summary``, the words of ``mlxspec generate``'s stats), ``γ 4``,
    ``γ auto`` with ``detail`` in brackets, or ``plain decoding`` when nothing is drafted."""
    kind = drafter_types().get(drafter)
    if (kind is not None and kind.plain) or gamma == 0:
        return "plain decoding"
    if shape:  # a tree's shape, and with γ picked each round its depth
        return shape + (f"; depth γ {gamma} ({detail})" if detail and isinstance(gamma, str) else "")
    return f"γ {gamma}" + (f" ({detail})" if detail and isinstance(gamma, str) else "")


def stats_drafting(stats: StatsSnapshot, now: bool = True) -> str:
    """``drafting`` for an answer: with γ picked each round, the latest pick (``now``) and the mean; ``drafted
    0`` and no γ while a drafter has drafted nothing (a lookup that found nothing, or auto falling back)."""
    if stats.rounds and not stats.drafted and stats.drafter != "none" and stats.num_draft_tokens:
        return "drafted 0"
    detail = ""
    if stats.policy and stats.rounds:
        detail = (f"now {stats.gamma_now}, " if now else "") + f"mean {stats.gamma_mean:.1f}"
    return drafting(stats.drafter, stats.policy or stats.num_draft_tokens, stats.shape, detail)


def alpha_text(stats: StatsSnapshot) -> str:
    """α to two decimals, or ``–`` while nothing was drafted (plain decoding, or auto falling back)."""
    return f"{stats.alpha:.2f}" if stats.drafted else "–"
