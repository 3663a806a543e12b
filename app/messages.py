"""Messages from the engine thread to the UI (toolong keeps its messages in one module too).

The engine posts them with ``post_message``, which is thread-safe and never blocks. They carry
plain Python values only (``str``, ``int``, ``float``, tuples), never an ``mx.array``.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message


@dataclass(frozen=True)
class EngineInfo:
    """What is loaded and in use.

    Attributes:
        model_name: Display name of the target model.
        quantized: Whether the target has quantized layers.
        draft_name: Display name of the loaded draft model, or ``None``.
        drafter: Drafter in use (``"draft"``, ``"ngram"``, ``"none"``, ...).
        num_draft_tokens: γ, tokens drafted per round, or ``"auto"``.
        drafters: Every drafter name the engine knows.
        options: The drafter's options that differ from their defaults, as ``(field, text)`` pairs
            (what its spec string or ``--<drafter>-<field>`` flags set).
        dtype, draft_dtype: The dtypes the target and draft model were loaded in; ``None`` = as stored.
        shape: What a tree drafter proposes each round, in the words of ``mlxspec generate``'s stats
            (``pacing.tree_summary``: ``"depth-4 chain + a 6-token n-gram branch"``); ``None`` when γ says it.
    """

    model_name: str
    quantized: bool
    draft_name: str | None
    drafter: str
    num_draft_tokens: int | str
    drafters: tuple[str, ...]
    options: tuple[tuple[str, str], ...] = ()
    dtype: str | None = None
    draft_dtype: str | None = None
    shape: str | None = None


@dataclass(frozen=True)
class StatsSnapshot:
    """Running totals of one answer, as the stats panel shows them.

    Attributes:
        drafter: Drafter in use.
        num_draft_tokens: γ in use (0 for plain decoding); with ``policy`` the largest it may pick.
        rounds: Verify rounds so far.
        tokens: Tokens committed so far.
        tau: Mean acceptance length τ (accepted + 1 per round), tokens/round.
        tau_round: τ of the latest round, tokens.
        alpha: Acceptance rate α = accepted / drafted.
        tokens_per_s: Generation speed, tokens/s (prefill excluded).
        draft_s: Time spent drafting, seconds.
        verify_s: Time spent verifying, seconds.
        taus: τ of the latest rounds, oldest first (for the sparkline).
        drafted: Draft tokens proposed so far (α means nothing while it is 0).
        policy: ``"auto"`` or ``"scheduled"`` when γ is picked each round, else ``None`` (γ is fixed).
        gamma_now: γ picked for the latest round (``RoundStats.gamma``).
        gamma_mean: Mean γ picked over the rounds so far.
        shape: What a tree drafter proposes each round (``EngineInfo.shape``), or ``None``.
    """

    drafter: str
    num_draft_tokens: int
    rounds: int = 0
    tokens: int = 0
    tau: float = 0.0
    tau_round: int = 0
    alpha: float = 0.0
    tokens_per_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    taus: tuple[int, ...] = ()
    drafted: int = 0
    policy: str | None = None
    gamma_now: int = 0
    gamma_mean: float = 0.0
    shape: str | None = None


@dataclass
class LoadProgress(Message):
    """A loading step started: ``step`` of ``total`` (from 1), described by ``what``."""

    what: str
    step: int
    total: int


@dataclass
class EngineReady(Message):
    """Models and drafter are ready (after start-up or a switch)."""

    info: EngineInfo


@dataclass
class LoadFailed(Message):
    """Loading a model or building a drafter failed; what was loaded before stays in use."""

    error: str


@dataclass
class TokensCommitted(Message):
    """A batch of committed tokens: ``(text, kind)`` per token with text, in order."""

    request_id: int
    spans: tuple[tuple[str, str], ...]


@dataclass
class StatsUpdated(Message):
    """Running stats after a round; a newer one supersedes a queued one."""

    request_id: int
    stats: StatsSnapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsUpdated) and message.request_id == self.request_id


@dataclass
class GenerationDone(Message):
    """An answer ended: a stop token, ``max_tokens``, or cancelled by the user."""

    request_id: int
    cancelled: bool
    finish_reason: str | None
    stats: StatsSnapshot


@dataclass
class GenerationFailed(Message):
    """An answer failed with ``error`` (one line); tokens posted before it stand."""

    request_id: int
    error: str
