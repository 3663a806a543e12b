"""How far each round drafts: a fixed γ, or γ auto from measured costs and the running acceptance. A
pacer hands the round a ``Plan`` and learns from its outcome; ``make_pacer`` makes it once, as
``make_sampler`` makes a sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..drafters.base import Draft, DraftProfile, Plan
from ..core.metrics import RoundStats
from .costs import MAX_VERIFY_TOKENS, Costs

PLAIN = Plan(0)
#: Plain rounds before the first look again after a fall-back, and the longest wait (doubling in between).
FIRST_WAIT, MAX_WAIT = 16, 256
#: γ auto drafting this many rounds in a row takes one plain step, so the costs know what a
#: plain step takes now.
REFERENCE_EVERY = 64


@dataclass
class AcceptanceEstimate:
    """Running per-depth acceptance as a product of conditional survivals, with exponential forgetting.

    A round that drafted K and kept n counts, at each depth i <= min(n + 1, K), one *reach* (the draft there
    was judged, its parent being kept) and, for i <= n, one keep. ``reach(m)[i]`` = h_1 · … · h_{i+1},
    h_i = keeps / reaches at depth i shrunk toward α (depth 1) or the pooled h of all deeper depths (itself
    shrunk toward α): the product-limit (Kaplan–Meier) estimate; drafts behind a rejection count nowhere
    (docs/design.md). Counts decay by ``1 − 1/window`` (16) a drafting round; ``prior_alpha`` (0.5) is α
    before any, ``prior_weight`` (2) the pseudo-rounds behind it and behind each shrinkage; ``kept``,
    ``reached`` the counts per depth.
    """

    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    window: float = 16.0
    kept: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Fold in one round (nothing for a round without drafts)."""
        if num_drafted <= 0:
            return
        decay = 1.0 - 1.0 / self.window
        for counts in (self.kept, self.reached):
            counts[:] = [c * decay for c in counts] + [0.0] * max(0, num_drafted - len(counts))
        for i in range(min(num_accepted + 1, num_drafted)):
            self.reached[i] += 1.0
            self.kept[i] += float(i < num_accepted)

    @property
    def alpha(self) -> float:
        """Acceptance at depth 1, shrunk to the prior."""
        kept, reached = (self.kept[0], self.reached[0]) if self.reached else (0.0, 0.0)
        return (kept + self.prior_weight * self.prior_alpha) / (reached + self.prior_weight)

    def reach(self, num_depths: int) -> list[float]:
        """``[i]`` = estimated P(the draft at depth i + 1 is kept), non-increasing in i."""
        alpha, w, out, above = self.alpha, self.prior_weight, [], 1.0
        pooled = (sum(self.kept[1:]) + w * alpha) / (sum(self.reached[1:]) + w)  # all depths below the first
        for i in range(num_depths):
            kept, reached = (self.kept[i], self.reached[i]) if i < len(self.reached) else (0.0, 0.0)
            above *= (kept + w * (alpha if i == 0 else pooled)) / (reached + w)
            out.append(above)
        return out


class Fixed:
    """The same depth ``gamma`` every round (0 = plain decoding). ``budget``: a priced tree's ``TreeBudget``,
    which may price a round plain; after 2 such rounds (or from the start, if the costs rule out every tree)
    the drafter rests 16, 32, … 256 rounds (reset by a kept node), then a probe keeps at least one node."""

    adaptive = False

    def __init__(self, gamma: int, budget=None):
        self.gamma = self.max_gamma = gamma
        self.budget = budget
        self._plan = Plan(gamma, budget=budget.choose if budget is not None else None)
        self._wait, self._next_wait, self._plain_run, self._probe = 0, FIRST_WAIT, 0, False
        if self.priced_out:
            self._wait, self._next_wait, self._probe = FIRST_WAIT, 2 * FIRST_WAIT, True

    @property
    def priced_out(self) -> bool:
        """Whether the costs now rule out every tree, even one whose every node is kept."""
        return (self.budget is not None
                and not self.budget.can_win(self.gamma, self.budget.costs.draft(self.gamma)))

    def plan(self) -> Plan:
        if self._wait > 0:
            self._wait -= 1
            return PLAIN
        if self.budget is not None:
            self.budget.allow_plain = not self._probe
        return self._plan

    def observe(self, outcome: RoundStats, draft: Draft | None = None) -> None:
        """Learn from one round: the costs, the budget's calibration, and its rests."""
        if self.budget is None:
            return
        self.budget.costs.observe(outcome)
        if outcome.gamma == 0:
            return
        probe, self._probe = self._probe, False
        self.budget.update(outcome.num_accepted)
        if outcome.num_accepted:
            self._next_wait = FIRST_WAIT
        if outcome.num_accepted or (outcome.num_drafted and not probe):
            self._plain_run = 0
        elif probe or self.budget.said_plain:
            self._plain_run += 1
            if probe or self._plain_run >= 2:  # priced plain twice in a row, or a probe kept nothing: rest
                self._wait, self._next_wait = self._next_wait, min(2 * self._next_wait, MAX_WAIT)
                self._plain_run, self._probe = 1, True

    def __eq__(self, other) -> bool:
        return (type(other) is Fixed
                and (other.gamma, other.budget is None) == (self.gamma, self.budget is None))


class Auto:
    """γ auto: before each round, the depth with the best predicted speed-up at the running acceptance.

    γ maximises τ(γ) · T_verify(1) / (T_draft(γ) + T_verify(nodes(γ) + 1)) (``Costs.speedup``, told every
    round) on the ``AcceptanceEstimate``; when no γ beats plain by ``margin`` the pacer decodes plainly for
    16, then 32, … 256 rounds (reset by a kept token) before a ``probe_gamma`` probe; the first round probes
    too, unless the costs rule out even a draft kept whole (then it waits first); every ``REFERENCE_EVERY``-th
    round in a row that drafts is a plain step (the costs' reference). A drafter that stops on its confidence
    (``DraftProfile.confidence``) is priced at one token and drafts on (``Plan.keep_above``) while the
    survival s of its first k tokens, times its calibration c (kept per survival claimed, ≤ 1), pays:
    s · c · T(1) > T_draft(1) + T(k + 2) − T(k + 1).

    Args: ``costs`` (this machine's), ``profile`` (the drafter's; default: a chain), ``margin`` (0.03: the
    predicted gain a γ > 0 needs), ``probe_gamma`` (2), ``estimate`` (an ``AcceptanceEstimate`` to
    continue; default: fresh).
    """

    adaptive = True

    def __init__(self, costs: Costs, profile: DraftProfile = DraftProfile(), *, margin: float = 0.03,
                 probe_gamma: int = 2, estimate: AcceptanceEstimate | None = None):
        self.costs, self.profile, self.margin = costs, profile, margin
        self.max_gamma = profile.max_depth or MAX_VERIFY_TOKENS - 1
        self.probe_gamma = min(probe_gamma, self.max_gamma)
        self.estimate = estimate or AcceptanceEstimate()
        self._priced = 1 if profile.confidence else self.max_gamma  # the deepest round a choice is priced at
        # decayed tokens kept and survival claimed (prior: 2 tokens, calibrated)
        self._kept_claimed = [2.0, 2.0]
        self._wait, self._next_wait, self._probe, self.probing, self._drafting = 0, FIRST_WAIT, True, False, 0
        if self.priced_out:
            self._wait, self._next_wait = FIRST_WAIT, 2 * FIRST_WAIT

    @property
    def priced_out(self) -> bool:
        """Whether the costs now predict no gain even if every draft were kept."""
        return self.costs.best_gamma(1.0, self.max_gamma, nodes=self.profile.nodes) == 0

    def plan(self) -> Plan:
        self.probing = False  # a plain step while waiting, and for the costs' reference:
        if self._wait > 0 or self._drafting >= REFERENCE_EVERY:
            self._wait = max(self._wait - 1, 0)
            return PLAIN
        gamma = self.costs.best_gamma(self.estimate.reach(self._priced), self._priced, self.margin,
                                      self.profile.nodes)
        if gamma == 0 and self._probe:
            gamma, self.probing = self.probe_gamma, True
        elif gamma == 0:
            self._wait, self._next_wait = self._next_wait, min(2 * self._next_wait, MAX_WAIT)
            self._probe = True  # the round after the wait looks again
            return PLAIN
        if not self.profile.confidence:
            return Plan(gamma)
        calibration = min(1.0, self._kept_claimed[0] / self._kept_claimed[1])
        verify = self.costs.verify
        return Plan(self.max_gamma, keep_above=tuple(
            (self.costs.draft(1) + verify(k + 2) - verify(k + 1)) / (calibration * verify(1))
            for k in range(1, self.max_gamma)))

    def observe(self, outcome: RoundStats, draft: Draft | None = None) -> None:
        """Learn from one round: the costs from every round; acceptance not from a plain one
        or an empty lookup."""
        self.costs.observe(outcome)
        self._drafting = self._drafting + 1 if outcome.gamma else 0
        depth = outcome.depth or outcome.num_drafted
        if depth <= 0:
            return
        self._probe = False
        self.estimate.update(depth, outcome.num_accepted)
        if outcome.num_accepted > 0:
            self._next_wait = FIRST_WAIT
        if self.profile.confidence and draft is not None and draft.survival is not None:
            # those compared
            claimed = np.array(draft.survival, dtype=np.float64)[: min(depth, self.max_gamma - 1)]
            decay = 1.0 - 1.0 / self.estimate.window
            self._kept_claimed = [self._kept_claimed[0] * decay + min(outcome.num_accepted, len(claimed)),
                                  self._kept_claimed[1] * decay + float(claimed.sum())]
