"""Records the engine yields: per-token events, per-round stats, run totals.

Acceptance rate α = accepted drafts / drafted tokens. Acceptance length τ =
tokens emitted per verify round (accepted + 1: the resampled or bonus token
counts), averaged over rounds. A round cut short by a stop or ``max_tokens`` counts
only what it emitted, so ``accepted`` never exceeds the tokens generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenEvent:
    """One committed token.

    Attributes:
        token: Token id.
        text: Text this token completes; ``""`` when it only starts a multi-byte
            character (the next token's event carries it) or is a stop token.
        kind: ``"accepted"`` (a draft the target kept), ``"resampled"`` (drawn from
            the residual after a rejection), ``"bonus"`` (drawn from p after every
            draft survived) or ``"target"`` (a plain decoding step, nothing drafted).
        round: Index of the verify round that committed it, from 0.
    """

    token: int
    text: str
    kind: str
    round: int


@dataclass(frozen=True)
class RoundStats:
    """One verify round.

    Attributes:
        round: Round index, from 0.
        num_drafted: Tokens proposed (γ for a full chain; fewer when the drafter
            found nothing or ``max_tokens`` is near).
        num_accepted: Drafts the target kept and the round emitted (a stop or ``max_tokens``
            inside the accepted drafts cuts this too).
        num_emitted: Tokens committed this round after stops (<= num_accepted + 1).
        draft_s: Seconds spent drafting (estimated for lazy drafters, see ``GenerationStats``).
        verify_s: Seconds spent in the target forward, acceptance and commit.
        depth: Deepest draft node (γ for a full chain; 0 when nothing was drafted).
        path: The draft nodes (0-based, root to leaf) the target accepted, before any stop cut.
        gamma: γ the pacer planned for the round (0: a plain round; a draft model that stops on its
            confidence: what it drafted); with ``auto`` it changes each round.
        rows: Generations verified in the same target forward (1: alone; more in the runner's batch, where
            ``verify_s`` is the whole batch's forward and a cost learned from it is not one row's).
    """

    round: int
    num_drafted: int
    num_accepted: int
    num_emitted: int
    draft_s: float
    verify_s: float
    depth: int = 0
    path: tuple[int, ...] = ()
    gamma: int = 0
    rows: int = 1


@dataclass
class GenerationStats:
    """Totals for one generation.

    Attributes:
        drafter: Name of the drafter used.
        num_draft_tokens: γ requested per round.
        prompt_tokens: Prompt length in tokens.
        prompt_s: Prefill wall time, seconds.
        cached_tokens: Prompt tokens found in a reused ``PromptCache`` (not prefilled again).
        generation_tokens: Tokens committed (including a final stop token).
        generation_s: Wall time from the end of prefill to the last token, seconds.
        rounds: Verify rounds run.
        drafted: Draft tokens proposed, all rounds.
        accepted: Draft tokens kept, all rounds.
        drafted_per_position: ``[i]`` = rounds that drafted a token at depth i + 1.
        accepted_per_position: ``[i]`` = rounds that accepted a token at depth i + 1.
        draft_s, verify_s: Time drafting and verifying, seconds. A drafter that runs
            on the device (a draft model) is timed exactly on every 8th round (an
            extra sync there) and its share is extrapolated to the others, so the
            other rounds keep one host sync.
        finish_reason: ``"stop"`` (a stop token), ``"length"`` (``max_tokens``) or
            ``None`` while running.
        peak_memory_gb: Peak device memory, GB.
        gamma_rounds: With ``--num-draft-tokens auto``, ``[γ]`` = rounds run with draft
            length γ (``[0]``: rounds that fell back to plain decoding because speculation
            was predicted to lose); empty with a fixed γ. ``num_draft_tokens`` is then
            the largest γ auto may pick.
    """

    drafter: str = "none"
    num_draft_tokens: int = 0
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    cached_tokens: int = 0
    generation_tokens: int = 0
    generation_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    finish_reason: str | None = None
    peak_memory_gb: float = 0.0
    gamma_rounds: list[int] = field(default_factory=list)

    def add_round(self, stats: RoundStats) -> None:
        """Fold one round into the totals."""
        self.rounds += 1
        self.drafted += stats.num_drafted
        self.accepted += stats.num_accepted
        self.generation_tokens += stats.num_emitted
        self.draft_s += stats.draft_s
        self.verify_s += stats.verify_s
        grow = stats.depth - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(stats.depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < stats.num_accepted

    def add_gamma(self, gamma: int) -> None:
        """Count one round run with draft length ``gamma`` chosen by auto-γ."""
        if gamma >= len(self.gamma_rounds):
            self.gamma_rounds += [0] * (gamma + 1 - len(self.gamma_rounds))
        self.gamma_rounds[gamma] += 1

    @property
    def gamma_mean(self) -> float:
        """Mean γ auto planned per round (0 with a fixed γ, whose rounds are not counted)."""
        picked = sum(self.gamma_rounds)
        return sum(g * n for g, n in enumerate(self.gamma_rounds)) / picked if picked else 0.0

    @property
    def plain_fallback_rounds(self) -> int:
        """Rounds in which auto-γ fell back to plain decoding (γ = 0)."""
        return self.gamma_rounds[0] if self.gamma_rounds else 0

    @property
    def alpha(self) -> float:
        """Acceptance rate α = accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Acceptance length τ = mean tokens emitted per verify round (accepted + 1 on uncut rounds)."""
        return self.generation_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """``[i]`` = fraction of drafts at depth i that were kept."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def prompt_tps(self) -> float:
        """Prefill speed over the tokens actually prefilled, tokens/s (the prompt's last token is the
        first round's input, and reused tokens are not prefilled; 0 when nothing was)."""
        prefilled = self.prompt_tokens - 1 - self.cached_tokens
        return prefilled / self.prompt_s if prefilled > 0 and self.prompt_s > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        """Generation speed, tokens/s."""
        return self.generation_tokens / self.generation_s if self.generation_s > 0 else 0.0

    def to_dict(self) -> dict:
        """Every field and derived metric as plain JSON-ready values."""
        out = dict(self.__dict__)
        for name in ("alpha", "tau", "acceptance_per_position", "prompt_tps", "generation_tps",
                     "plain_fallback_rounds"):
            out[name] = getattr(self, name)
        return out
