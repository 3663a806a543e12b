"""Drafters behind one small interface (``Drafter``), and ``make_drafter``."""

from __future__ import annotations

from ..taps import logits_width
from ..tree import DEFAULT_TREE
from .base import Draft, Drafter, NoDrafter
from .draft_model import DraftModelDrafter, check_same_tokenizer
from .eagle import EagleDrafter
from .medusa import MedusaDrafter
from .ngram import NgramDrafter

DRAFTERS = ("draft", "ngram", "medusa", "eagle", "none")

__all__ = ["DRAFTERS", "Draft", "Drafter", "DraftModelDrafter", "EagleDrafter", "MedusaDrafter", "NgramDrafter", "NoDrafter", "make_drafter"]


def make_drafter(
    kind: str,
    *,
    target=None,
    tokenizer=None,
    draft_model=None,
    draft_tokenizer=None,
    min_ngram: int = 1,
    max_ngram: int = 4,
    medusa_heads=None,
    medusa_tree: str = DEFAULT_TREE,
    eagle_head=None,
    eagle_depth: int | None = None,
    eagle_top_k: int | None = None,
    eagle_total_tokens: int | str | None = None,
    eagle_tree: str | None = None,
    eagle_costs=None,
    eagle_ngram: int | None = None,
) -> Drafter:
    """Build a drafter by name.

    Args:
        kind: ``"draft"`` (needs ``draft_model``), ``"ngram"`` or ``"none"``.
        target: The target model (``"draft"`` only; gives the vocabulary width V).
        tokenizer: The target's tokenizer (``"draft"`` only).
        draft_model, draft_tokenizer: The draft model and its tokenizer (``"draft"`` only).
        min_ngram, max_ngram: Suffix lengths for ``"ngram"``.
        medusa_heads: Loaded ``MedusaHeads`` (``"medusa"`` only; needs ``target``).
        medusa_tree: A tree preset name or a JSON file of rank paths (``"medusa"``).
        eagle_head: A loaded ``EagleHead`` (``"eagle"`` only; needs ``target``).
        eagle_depth, eagle_top_k, eagle_total_tokens: EAGLE-2 tree size (``EagleDrafter``);
            ``None`` = the head's shipped ``draft_tree``, else EAGLE-2's defaults (6, 10, 60);
            ``eagle_total_tokens="auto"`` sizes each round's tree from measured costs.
        eagle_costs: ``Costs`` (or a function returning them) for an ``"auto"`` tree size.
        eagle_ngram: Tokens of the n-gram lookup branch merged into each EAGLE tree (0 = none;
            ``None`` = the head's shipped setting).
        eagle_tree: ``"dynamic"`` (EAGLE-2), ``"eagle1_25"`` or a JSON file of rank paths (static).

    Raises:
        ValueError: on an unknown kind, a missing draft model or heads, a draft model whose
            tokenizer differs from the target's, a bad Medusa tree or bad EAGLE tree sizes.
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
    if kind == "medusa":
        if medusa_heads is None:
            raise ValueError("--drafter medusa needs Medusa heads: pass --medusa-heads PATH_OR_REPO")
        from ..taps import output_head
        from ..tree import read_tree

        return MedusaDrafter(medusa_heads, output_head(target), read_tree(medusa_tree))
    if kind == "eagle":
        if eagle_head is None:
            raise ValueError("--drafter eagle needs an EAGLE head: pass --eagle-heads PATH_OR_REPO")
        return EagleDrafter(eagle_head, target, depth=eagle_depth, top_k=eagle_top_k, total_tokens=eagle_total_tokens,
                            tree=eagle_tree, costs=eagle_costs, ngram=eagle_ngram)
    raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")
