"""Drafters behind one small interface (``Drafter``), and ``make_drafter``."""

from __future__ import annotations

from .base import Draft, Drafter, NoDrafter
from .draft_model import DraftModelDrafter, check_same_tokenizer, logits_width
from .ngram import NgramDrafter

DRAFTERS = ("draft", "ngram", "none")

__all__ = ["DRAFTERS", "Draft", "Drafter", "DraftModelDrafter", "NgramDrafter", "NoDrafter", "make_drafter"]


def make_drafter(
    kind: str,
    *,
    target=None,
    tokenizer=None,
    draft_model=None,
    draft_tokenizer=None,
    min_ngram: int = 1,
    max_ngram: int = 4,
) -> Drafter:
    """Build a drafter by name.

    Args:
        kind: ``"draft"`` (needs ``draft_model``), ``"ngram"`` or ``"none"``.
        target: The target model (``"draft"`` only; gives the vocabulary width V).
        tokenizer: The target's tokenizer (``"draft"`` only).
        draft_model, draft_tokenizer: The draft model and its tokenizer (``"draft"`` only).
        min_ngram, max_ngram: Suffix lengths for ``"ngram"``.

    Raises:
        ValueError: on an unknown kind, a missing draft model, or a draft model whose
            tokenizer differs from the target's.
    """
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter(min_ngram, max_ngram)
    if kind == "draft":
        if draft_model is None:
            raise ValueError("--drafter draft needs a draft model: pass --draft-model PATH_OR_REPO")
        if draft_tokenizer is not None:
            check_same_tokenizer(tokenizer, draft_tokenizer)
        return DraftModelDrafter(draft_model, logits_width(target), len(tokenizer))
    raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")
