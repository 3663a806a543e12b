"""N-gram prompt lookup: draft what followed the last n tokens earlier on.

Saxena 2023, "Prompt Lookup Decoding"; the same idea as vLLM's ``ngram``
speculator. No model; proposals are deterministic (q is one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import Draft, Drafter
from .registry import DrafterType, option, register
from .suffix import longest_match

#: Shortest suffix matched by default. 3, not 1: a 1- or 2-token match is mostly chance (any token seen before
#: matches), its drafts miss, and under γ auto those misses make the policy back off for 16+ rounds just when
#: the answer starts copying. Measured on Qwen2.5-Coder-1.5B (docs/archive/results-archive.md, runs G and H),
#: γ auto, min 3
#: against min 1: 1.35× -> 2.18× plain decoding (median of 4 code edits), 0.98× -> 1.07× (4 open prompts).
DEFAULT_MIN_NGRAM = 3
#: Longest suffix matched by default. 8, not 4: the longest match picks the occurrence that continues as the
#: answer does (an edit repeats 4-token runs all over the code; 6-8 tokens tell them apart). Replayed on
#: Qwen2.5-Coder-1.5B's greedy answers to 4 code edits with its measured verify costs
#: (docs/archive/results-archive.md, run N):
#: γ auto 2.21 -> 2.46x plain on the rename, the others equal or better, never worse; 6 to 16 give the same.
#: Measured in the same run: the rename 2.41 -> 2.90x, identical rounds on the other three.
DEFAULT_MAX_NGRAM = 8
#: Suffix lengths of EAGLE's n-gram branch (``lookup_continuation``'s default): 4 down to 1.
BRANCH_MAX_NGRAM = 4


def lookup_continuation(
    history: np.ndarray, max_tokens: int, min_ngram: int = 1, max_ngram: int = BRANCH_MAX_NGRAM
) -> np.ndarray:
    """Find the longest suffix n-gram seen before and return what followed it.

    The longest n <= ``max_ngram`` whose last-n tokens occur earlier in ``history`` (if n >=
    ``min_ngram``): its most recent earlier occurrence, and up to ``max_tokens`` tokens that
    followed it. One comparison over ``history``, then the matches are extended backwards
    (``suffix.longest_match``), so a longer ``max_ngram`` costs almost nothing.

    Args:
        history (np.ndarray): Committed tokens, shape [L], integer.
        max_tokens: Most tokens to return.
        min_ngram, max_ngram: Range of suffix lengths to match. Default: 1..4 (EAGLE's n-gram branch);
            the n-gram drafter passes its own (``DEFAULT_MIN_NGRAM``, ``DEFAULT_MAX_NGRAM``).

    Returns:
        np.ndarray: The continuation, shape [<= max_tokens]; empty when nothing matches.
    """
    # occurrences with a token after them, so never the suffix itself; one scan, extended backwards
    length, ends = longest_match(history, history, max_ngram)
    if length < min_ngram:
        return history[:0]
    start = ends[-1] + 1
    return history[start : start + max_tokens]


class NgramDrafter(Drafter):
    """Prompt-lookup drafter over prompt + output.

    Args:
        min_ngram: Shortest suffix to match. Default: ``DEFAULT_MIN_NGRAM`` (3, which says why), or
            ``max_ngram`` if that is shorter.
        max_ngram: Longest suffix to match (tried first). Default: ``DEFAULT_MAX_NGRAM`` (8, which says why).

    Raises:
        ValueError: if ``1 <= min_ngram <= max_ngram`` does not hold.
    """

    name = "ngram"

    def __init__(self, min_ngram: int | None = None, max_ngram: int = DEFAULT_MAX_NGRAM):
        min_ngram = min(DEFAULT_MIN_NGRAM, max_ngram) if min_ngram is None else min_ngram
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got min={min_ngram}, max={max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.min_ngram, self.max_ngram)  # it keeps no state between rounds

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        found = lookup_continuation(np.asarray(history), num_draft_tokens, self.min_ngram, self.max_ngram)
        return Draft.chain(found.tolist())


@dataclass(frozen=True)
class NgramOptions:
    """``--drafter ngram`` (spec ``ngram:min=1,max=4``).

    Raises:
        ValueError: unless ``1 <= min <= max``.
    """

    min: int | None = option(None, "shortest suffix the n-gram drafter matches", parse=int,
                             default_help=f"{DEFAULT_MIN_NGRAM}, or the longest if that is shorter")
    max: int = option(DEFAULT_MAX_NGRAM, "longest suffix the n-gram drafter matches", parse=int)

    def __post_init__(self):
        if not 1 <= self.shortest <= self.max:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got min={self.shortest}, max={self.max} "
                             "(--ngram-min, --ngram-max)")

    @property
    def shortest(self) -> int:
        """``min``, or when not given ``DEFAULT_MIN_NGRAM`` capped at ``max`` (``ngram:max=2`` alone means
        2..2)."""
        return min(DEFAULT_MIN_NGRAM, self.max) if self.min is None else self.min


def build(options: NgramOptions, context) -> NgramDrafter:
    return NgramDrafter(options.shortest, options.max)


DRAFTER = register(
    DrafterType(
        "ngram",
        NgramOptions,
        build,
        "prompt lookup: drafts what followed the last n tokens earlier on; no model",
        order=20,
    )
)
