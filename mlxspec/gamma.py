"""γ policies: how many tokens each round drafts, chosen once per generation by ``gamma_policy``.

The CLI, the chat and the Python API all call ``gamma_policy``, so ``--num-draft-tokens auto``
and ``stream_generate(..., num_draft_tokens="auto")`` mean the same thing for every drafter:

- a drafter that sizes its own rounds (``tree_depth``: EAGLE, MTP, a Medusa tree) gets
  ``costmodel.AutoGamma`` capped at that depth, each round priced at the nodes it actually sends to
  the target (``Drafter.round_nodes``: a tree or an n-gram branch verifies more nodes than its
  depth), so it drafts less deep or falls back to plain decoding when its drafts miss; where the
  measured costs say no round up to that depth could beat a plain step even if every draft were
  accepted (``round_can_win``), every round is a plain step and the drafter never runs
  (``PricedPlain``);
- any other drafter gets ``costmodel.AutoGamma``: γ per round from this machine's measured costs
  and the running acceptance, falling back to plain decoding when speculation would lose; a drafter
  that can stop a round on its own confidence (``Drafter.stops_early``: the draft model) drafts while
  the next token pays for itself (``AutoGamma.keep_drafting``);
- ``--drafter none`` and ``0`` are plain decoding; an integer is a fixed γ;
- ``scheduled`` (a drafter that estimates each drafted token's survival): the drafter drafts its
  full length and ``schedule.ScheduledGamma`` verifies the part with the best predicted tokens/s
  (docs/acceptance.md 3.1). It is a word of its own, not a kind of ``auto``: it needs those
  estimates, which not every drafter has, and it reads them on the host before verifying.

Where a tree drafter keeps its own shape, a γ says little: ``tree_summary`` says in words what it
drafts each round (``mlxspec generate``'s stats and the chat's panel both show it).
"""

from __future__ import annotations

from collections.abc import Callable

from .calibration import load_or_calibrate
from .costmodel import MAX_VERIFY_TOKENS, AutoGamma, Costs
from .drafters import Drafter
from .schedule import DEFAULT_SCHEDULED_MAX, ScheduledGamma
from .tree import TREE_PRESETS

#: ``num_draft_tokens`` value that lets the policy choose.
AUTO = "auto"
#: ``num_draft_tokens`` value for confidence-scheduled verification (``schedule.ScheduledGamma``).
SCHEDULED = "scheduled"
#: Largest fixed γ: ``mlxspec generate``/``chat``, the chat's F2 dialog and the API all refuse more. Four
#: times what auto ever picks (15); a round that wide verifies like a prefill chunk, so a larger γ is a typo.
MAX_NUM_DRAFT_TOKENS = 64


def check_num_draft_tokens(gamma: int, name: str = "num_draft_tokens") -> None:
    """Refuse a fixed γ outside ``0..MAX_NUM_DRAFT_TOKENS``.

    Raises:
        ValueError: naming ``name`` (a flag or field) and the allowed range.
    """
    if not 0 <= gamma <= MAX_NUM_DRAFT_TOKENS:
        raise ValueError(f"{name} must be from 0 to {MAX_NUM_DRAFT_TOKENS} (0 = plain decoding), got {gamma}")


class FixedGamma:
    """The same γ every round.

    Args:
        gamma: Tokens drafted per round (0 = plain decoding).

    Raises:
        ValueError: ``gamma`` outside ``0..MAX_NUM_DRAFT_TOKENS``.
    """

    #: Whether the per-round choice is recorded in the stats (it is the same every round).
    adaptive = False

    def __init__(self, gamma: int):
        check_num_draft_tokens(gamma)
        self.max_gamma = self.gamma = gamma

    def choose_gamma(self) -> int:
        """γ for the next round."""
        return self.gamma

    def update(self, cycle) -> None:
        """Nothing to learn."""

    def __eq__(self, other) -> bool:
        return type(other) is FixedGamma and other.gamma == self.gamma

    def __repr__(self) -> str:
        return f"FixedGamma({self.gamma})"


class PricedPlain(FixedGamma):
    """γ auto priced as plain decoding: γ = 0 every round.

    ``gamma_policy`` picks it when no round up to the drafter's depth (its ``tree_depth``, else 15) could beat
    a plain step on this machine's measured costs even if every draft were accepted (``round_can_win``), so
    the drafter never runs, not even over the prompt.

    Args:
        depth: The depth its rounds would have drafted to.
    """

    #: Whether γ auto priced the drafter's rounds as plain decoding (``tree_summary`` and the stats say so).
    priced_plain = True

    def __init__(self, depth: int):
        super().__init__(0)
        self.depth = depth

    def __eq__(self, other) -> bool:
        return type(other) is PricedPlain and other.depth == self.depth

    def __repr__(self) -> str:
        return f"PricedPlain({self.depth})"


def round_can_win(costs: Costs, depth: int, nodes: Callable[[int], int] | None = None) -> bool:
    """Whether a round of some depth γ <= ``depth`` could beat a plain step on ``costs`` even if every draft
    were accepted: γ + 1 tokens in ``costs.draft(γ)`` + T_verify(nodes(γ) + 1) seconds against one token
    in T_verify(1) (``load_or_calibrate`` times a drafter that sizes its rounds on one of ``tree_depth``).

    Args:
        costs: This machine's measured ``Costs`` for the target and the drafter.
        depth: The drafter's ``tree_depth``.
        nodes: Draft nodes a round of depth γ verifies (``Drafter.round_nodes``). Default: γ, a chain.
    """
    return costs.best_gamma(1.0, depth, nodes=nodes)[0] > 0


def auto_priced_plain(drafter: Drafter, costs: Costs) -> bool:
    """Whether γ auto runs ``drafter`` as plain decoding (``PricedPlain``): no round up to its depth (its
    ``tree_depth``, else 15) can win on ``costs`` (``round_can_win`` on its ``round_nodes``), as for a draft
    model slower than its target. A Medusa tree priced each round is checked at load instead
    (``MedusaDrafter.priced_plain``)."""
    if _prices_itself(drafter):
        return False
    return not round_can_win(costs, drafter.tree_depth or MAX_VERIFY_TOKENS - 1, drafter.round_nodes)


def _prices_itself(drafter) -> bool:
    return drafter.name == "medusa" and drafter.budget is not None


GammaPolicy = FixedGamma | AutoGamma | ScheduledGamma
"""What the round loop asks before each round (``choose_gamma``) and tells after it (``update``)."""


def gamma_policy(num_draft_tokens: int | str | GammaPolicy, model, drafter: Drafter, *,
                 costs: Costs | None = None, on_measure: Callable[[str], None] | None = None) -> GammaPolicy:
    """The γ policy for one generation.

    Args:
        num_draft_tokens: An integer γ from 0 to ``MAX_NUM_DRAFT_TOKENS``, ``"auto"``, ``"scheduled"``, or a
            policy to reuse as it is (an ``AutoGamma`` or ``ScheduledGamma`` keeps what it learned across answers).
        model: The target (its verify cost is measured for ``"auto"``).
        drafter: The drafter the rounds use.
        costs: Measured ``Costs`` to use for ``"auto"`` instead of the cached or measured ones.
        on_measure: Told before a cost measurement that was not cached. Default: none.

    Returns:
        GammaPolicy: ``FixedGamma`` (``PricedPlain`` for a drafter that sizes its own rounds under ``"auto"``
        when none can win here), ``AutoGamma`` (capped at ``tree_depth`` and priced on ``round_nodes`` for
        such a drafter) or ``ScheduledGamma``.

    Raises:
        ValueError: a γ outside ``0..MAX_NUM_DRAFT_TOKENS``, a string other than ``"auto"`` and
            ``"scheduled"``, or ``"scheduled"`` with a drafter that reports no survival estimates.
    """
    if isinstance(num_draft_tokens, (FixedGamma, AutoGamma, ScheduledGamma)):
        return num_draft_tokens
    if isinstance(num_draft_tokens, str) and num_draft_tokens not in (AUTO, SCHEDULED):
        raise ValueError(f"num_draft_tokens must be an integer from 0 to {MAX_NUM_DRAFT_TOKENS}, 'auto' or "
                         f"'scheduled', got {num_draft_tokens!r}")
    if isinstance(num_draft_tokens, int):
        check_num_draft_tokens(num_draft_tokens)
    if drafter.name == "none":
        return FixedGamma(0)
    if num_draft_tokens == SCHEDULED:
        if not drafter.reports_survival:
            raise ValueError(f"--num-draft-tokens scheduled needs a drafter that estimates each drafted token's "
                             f"survival (draft, medusa, eagle with a dynamic tree or chain, dflash, dspark); the {drafter.name} "
                             "drafter does not: use 'auto' or an integer")
        costs = costs if costs is not None else load_or_calibrate(model, drafter, on_measure=on_measure)
        return ScheduledGamma(costs, max_gamma=drafter.tree_depth or drafter.max_draft_tokens or DEFAULT_SCHEDULED_MAX)
    if num_draft_tokens != AUTO:
        return FixedGamma(num_draft_tokens)
    if drafter.tree_depth is not None:  # its depth follows γ up to its own; a round costs its nodes
        if _prices_itself(drafter):
            return FixedGamma(drafter.tree_depth)
        costs = costs if costs is not None else load_or_calibrate(model, drafter, on_measure=on_measure)
        if auto_priced_plain(drafter, costs):
            return PricedPlain(drafter.tree_depth)
        return AutoGamma(costs, max_gamma=drafter.tree_depth, nodes=drafter.round_nodes)
    costs = costs if costs is not None else load_or_calibrate(model, drafter, on_measure=on_measure)
    if auto_priced_plain(drafter, costs):  # e.g. a draft model slower than its target: never run it
        return PricedPlain(MAX_VERIFY_TOKENS - 1)
    return AutoGamma(costs, stop_early=drafter.stops_early, judges=drafter.judges)


#: What a Medusa tree priced as plain decoding at load time says (``TreeBudget.can_win``).
PRICED_PLAIN = "tree auto → plain: the cost model predicts no gain on this machine, so the heads are not run"
#: What γ auto says of a drafter whose rounds it priced as plain decoding (``PricedPlain``).
AUTO_PRICED_PLAIN = ("γ auto → plain: the cost model predicts no gain on this machine even if every draft were "
                     "accepted, so the drafter is not run")


def priced_plain(drafter, policy=None) -> bool:
    """Whether every round is a plain step because the costs ruled the drafter out: a Medusa tree priced
    at load, or γ auto's ``PricedPlain``."""
    return bool(getattr(drafter, "priced_plain", False) or getattr(policy, "priced_plain", False))


def tree_summary(drafter, policy=None) -> str | None:
    """What a tree drafter proposes, e.g. ``"tree mc_sim_7b_63 (63 nodes, depth 4)"`` or ``"depth-4 chain + a
    6-token n-gram branch"``; ``None`` when the drafter says nothing about its tree (γ then describes
    its rounds). With ``policy`` (the generation's γ policy) a ``PricedPlain`` says ``AUTO_PRICED_PLAIN``."""
    if getattr(policy, "priced_plain", False):
        return AUTO_PRICED_PLAIN
    if drafter.name == "medusa":
        if drafter.priced_plain:
            return PRICED_PLAIN
        size = len(drafter.choices)
        preset = next((name for name, choices in TREE_PRESETS.items() if choices == drafter.choices), "from a file")
        priced = ", the nodes this machine's verify cost pays for, each round" if drafter.budget is not None else ""
        return f"tree {preset} ({size} nodes, depth {drafter.tree_depth}{priced})"
    if drafter.name == "eagle":
        if drafter.choices is not None:
            shape = f"static tree of {len(drafter.choices)} nodes, depth {drafter.depth}"
        elif drafter.top_k == 1:
            shape = f"depth-{drafter.depth} chain"
        else:
            total = "sized each round" if drafter.budget is not None else f"at most {drafter.total_tokens} nodes"
            shape = f"EAGLE-2 tree (depth {drafter.depth}, top-{drafter.top_k}, {total})"
        return shape + (f" + a {drafter.ngram}-token n-gram branch" if drafter.ngram else "")
    return None
