"""``--drafter none``: plain decoding through the speculative loop (nothing is ever drafted)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Draft, Drafter, DraftProfile
from .registry import DrafterType, register


class NoDrafter(Drafter):
    """Plain decoding through the speculative loop: nothing is ever drafted."""

    name = "none"
    profile = DraftProfile(plain=True)

    def fork(self) -> NoDrafter:
        return NoDrafter()  # plain rows batch like any other (it keeps no state)

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        return Draft.empty()


@dataclass(frozen=True)
class NoOptions:
    """``--drafter none`` takes no options."""


DRAFTER = register(DrafterType("none", NoOptions, lambda options, context: NoDrafter(),
                               "plain decoding (one target step per token), through the same loop", order=90,
                               plain=True))
