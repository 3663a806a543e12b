"""One generation's output as records: each round's tokens → ``TokenEvent``s and running ``GenerationStats``.

The one place where rounds become text and totals (τ, α, the γ each round ran with), for the one-request loop
(``generate.stream_generate``) and for every row of the runner's batch (``runner.Runner``) alike. Text deltas
never split a multi-byte character, hold back a tail that may start a stop string, and end on the last whole
character: a generation cut inside a character (``max_tokens``) drops its incomplete bytes instead of ending
with U+FFFD.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from ..core.metrics import GenerationStats, RoundStats, TokenEvent
from ..core.stops import HeldText, StopStrings

#: The replacement character a detokenizer emits for bytes that are not (yet) a whole character.
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Committed:
    """What one round committed, as a consumer of the runner sees it.

    Attributes:
        events: The round's ``TokenEvent``s (text deltas; ``""`` for a token that only starts a character).
        round: The round's ``RoundStats``.
        totals: The running totals after this round (a copy: safe to keep and read on another thread).
        finish_reason: ``"stop"`` or ``"length"`` when the generation ended with this round, else ``None``.
    """

    events: tuple[TokenEvent, ...]
    round: RoundStats
    totals: GenerationStats
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        """The text the round's tokens complete."""
        return "".join(event.text for event in self.events)


class Output:
    """Turns one generation's rounds into events and totals.

    Args:
        tokenizer: The target's ``TokenizerWrapper`` (its streaming detokenizer is copied).
        stats: The generation's totals, filled in as rounds come (``prompt_tokens`` etc. set by the caller).
        stop_tokens: Ids that end generation (never detokenized).
        stops: The stop strings (``stops.check_stops``).
        stopper: The ``StopStrings`` that cuts rounds at a stop string, or ``None``.
        adaptive: Whether γ changes each round (count each round's γ in ``stats.gamma_rounds``).
    """

    def __init__(self, tokenizer, stats: GenerationStats, stop_tokens: set[int], stops: tuple[str, ...],
                 stopper: StopStrings | None, adaptive: bool):
        self.stats, self.stop_tokens, self.stopper, self.adaptive = stats, stop_tokens, stopper, adaptive
        self.detokenizer, self.held = tokenizer.detokenizer, HeldText(stops)  # a fresh detokenizer per call
        self.start: float | None = None  # when decoding started (the end of prefill)

    def round(self, tokens: list[int], kinds: list[str], stats: RoundStats, finish_reason: str | None,
              now: float | None = None) -> list[TokenEvent]:
        """Fold one round into the totals; return its ``TokenEvent``s.

        Args:
            tokens, kinds: The round's committed tokens and where each came from (after stops and limits).
            stats: The round's ``RoundStats``.
            finish_reason: ``"stop"``/``"length"`` when the generation ends with this round, else ``None``.
            now: ``time.perf_counter()`` at the end of the round (default: now).
        """
        now = time.perf_counter() if now is None else now
        if self.start is None:
            self.start = now - stats.draft_s - stats.verify_s
        self.stats.add_round(stats)
        if self.adaptive:
            self.stats.add_gamma(stats.gamma)
        self.stats.generation_s = now - self.start
        if finish_reason:
            self.stats.finish_reason = finish_reason
        events, last = [], len(tokens) - 1
        for i, (token, kind) in enumerate(zip(tokens, kinds)):
            if token not in self.stop_tokens:
                self.detokenizer.add_token(token)
            final = bool(finish_reason) and i == last
            if final:
                self.detokenizer.finalize()
            segment = self.detokenizer.last_segment
            if final and finish_reason == "length":  # cut inside a character: end on the last whole one
                segment = segment.rstrip(REPLACEMENT)
            text = self.held.push(segment, final, self.stopper.text_end if self.stopper else None)
            events.append(TokenEvent(token, text, kind, stats.round))
        return events

    def snapshot(self) -> GenerationStats:
        """A copy of the running totals (its lists copied too)."""
        return copy.deepcopy(self.stats)
