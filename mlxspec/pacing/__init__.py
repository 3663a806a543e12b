"""How far to draft: measured costs, the acceptance estimate, node budgets and the pacers (fixed, auto,
scheduled). The round asks its pacer for a ``Plan`` and hands it the outcome (``plan``/``observe``);
``make_pacer`` makes it for the CLI, the chat, the server and the Python API alike. A drafter only declares a
``DraftProfile`` (docs/design.md)."""

from __future__ import annotations

from collections.abc import Callable

from ..drafters.base import AUTO, Drafter, Plan
from .batch import BatchGate
from .costs import (
    DEFAULT_CONTEXT_TOKENS,
    MAX_VERIFY_TOKENS,
    Costs,
    LearnedCosts,
    drafter_fingerprint,
    expected_tau,
    load_or_calibrate,
)
from .policies import PLAIN, AcceptanceEstimate, Auto, Fixed
from .scheduled import DEFAULT_SCHEDULED_MAX, NUM_BINS, Scheduled
from .trees import TreeBudget

#: The ``num_draft_tokens`` value that schedules verification (DSpark); ``AUTO`` lets the pacer choose γ.
SCHEDULED = "scheduled"
#: Largest fixed γ (the CLI, the chat and the API refuse more): four times what auto drafts; more is a typo.
MAX_NUM_DRAFT_TOKENS = 64
#: What the stats say of a drafter the costs rule out for now (looked at again as its rounds correct them).
PRICED_PLAIN = (
    "γ auto → plain: the costs predict no gain on this machine even if every draft were accepted; "
    "looking again after 16, 32, … 256 plain rounds"
)

Pacer = Fixed | Auto | Scheduled
"""What the round asks before each round (``plan()``) and tells after it (``observe(outcome, draft)``)."""

__all__ = [
    "AUTO",
    "DEFAULT_CONTEXT_TOKENS",
    "MAX_NUM_DRAFT_TOKENS",
    "MAX_VERIFY_TOKENS",
    "NUM_BINS",
    "PLAIN",
    "PRICED_PLAIN",
    "SCHEDULED",
    "AcceptanceEstimate",
    "Auto",
    "BatchGate",
    "Costs",
    "Fixed",
    "LearnedCosts",
    "Pacer",
    "Plan",
    "Scheduled",
    "TreeBudget",
    "check_num_draft_tokens",
    "drafter_fingerprint",
    "expected_tau",
    "load_or_calibrate",
    "make_pacer",
    "tree_summary",
]


def check_num_draft_tokens(gamma: int, name: str = "num_draft_tokens") -> None:
    """Refuse a fixed γ outside ``0..MAX_NUM_DRAFT_TOKENS``: ``ValueError`` naming ``name`` (a flag or
    field)."""
    if not 0 <= gamma <= MAX_NUM_DRAFT_TOKENS:
        raise ValueError(f"{name} must be from 0 to {MAX_NUM_DRAFT_TOKENS} (0 = plain decoding), got {gamma}")


def make_pacer(num_draft_tokens: int | str | Pacer, model, drafter: Drafter, *, costs: Costs | None = None,
               on_measure: Callable[[str], None] | None = None, learn: bool = True) -> Pacer:
    """The pacer of one generation: ``Fixed`` for an integer γ (0, or ``--drafter none``: plain decoding);
    ``Auto`` for ``"auto"``, capped at the profile's ``max_depth``; ``Scheduled`` for ``"scheduled"``. A
    priced tree (``DraftProfile.budget``) drafts its depth (or the γ given) cut by a ``TreeBudget`` under any
    γ. The costs are corrected by the rounds they price (``LearnedCosts``); a drafter they rule out is looked
    at again after waits of 16 … 256 plain rounds, never dropped.

    Args: ``num_draft_tokens`` (γ from 0 to ``MAX_NUM_DRAFT_TOKENS``, ``"auto"``, ``"scheduled"``, or a pacer
    to reuse: it keeps what it learned across answers); ``model`` (the target: its costs are measured when
    needed, once per machine), ``drafter``; ``costs`` (instead of the cached or measured ones);
    ``on_measure`` (told before a measurement that was not cached); ``learn`` (``True``: the costs learn from
    the rounds' timings; ``False``: tests).
    Raises ``ValueError``: a γ outside the range, another string, or ``"scheduled"`` for a drafter without
    survival.
    """
    if isinstance(num_draft_tokens, (Fixed, Auto, Scheduled)):
        return num_draft_tokens
    if isinstance(num_draft_tokens, str) and num_draft_tokens not in (AUTO, SCHEDULED):
        raise ValueError(f"num_draft_tokens must be an integer from 0 to {MAX_NUM_DRAFT_TOKENS}, 'auto' or "
                         f"'scheduled', got {num_draft_tokens!r}")
    if isinstance(num_draft_tokens, int):
        check_num_draft_tokens(num_draft_tokens)
    profile = drafter.profile
    if drafter.profile.plain or num_draft_tokens == 0:
        return Fixed(0)
    if num_draft_tokens == SCHEDULED and not profile.survival:
        raise ValueError(
            f"--num-draft-tokens scheduled needs a drafter that estimates each drafted token's survival "
            f"(draft, medusa, eagle with a dynamic tree or chain, dflash, dspark); the {drafter.name} "
            "drafter does not: use 'auto' or an integer"
        )
    if costs is None and (isinstance(num_draft_tokens, str) or profile.budget):
        costs = load_or_calibrate(model, drafter, on_measure=on_measure)
    costs = LearnedCosts(costs) if learn and costs is not None else costs
    depth = profile.max_depth or MAX_VERIFY_TOKENS - 1
    if num_draft_tokens == SCHEDULED:
        return Scheduled(costs, max_gamma=profile.max_depth or DEFAULT_SCHEDULED_MAX)
    if profile.budget:  # a priced tree, under any γ
        budget = TreeBudget(costs, max_nodes=profile.nodes[-1] if profile.nodes else 63)
        return Fixed(depth if num_draft_tokens == AUTO else num_draft_tokens, budget)
    return Fixed(num_draft_tokens) if num_draft_tokens != AUTO else Auto(costs, profile)


def tree_summary(drafter: Drafter, pacer: Pacer | None = None) -> str | None:
    """A tree drafter's ``describe()``, ``PRICED_PLAIN`` while the costs rule it out (``pacer.priced_out``),
    or ``None`` (then γ says what a round drafts)."""
    if pacer is not None and pacer.priced_out:
        return PRICED_PLAIN
    return drafter.describe() if drafter.makes_trees else None
