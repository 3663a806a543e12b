"""Pacing for a batch: whether this round's drafts pay at this batch size, decided before anything is
drafted."""

from __future__ import annotations

import itertools

from ..drafters.base import Plan
from .policies import FIRST_WAIT, MAX_WAIT, Auto

#: The predicted gain a speculative batch round needs over a plain batched step (as ``Auto``'s margin).
MARGIN = 0.03
_PLAIN = Plan(0)


class BatchGate:
    """With every row on γ auto, a round verifies R rows × k tokens in one forward, k = 1 + the widest row's
    γ (rows are padded to it). The gate caps every row's γ at the g that maximises the predicted tokens per
    second of the batch: Σ_r τ_r(min(γ_r, g)) (each row's own acceptance estimate) over the seconds of
    drafting plus the forward over R × (1 + the widest capped γ), read from the measured cost of that forward
    (``Costs.verify_rows``). Rows drafting ``together`` (one draft forward per token for all:
    ``engine/batch_draft.py``) cost one row's drafting of their deepest γ, scaled as the target's forward over
    as many rows. Where no cap beats a plain batched step (R tokens per ``verify_rows(R, 1)``) by ``MARGIN``,
    the batch decodes plainly for 16 rounds, then 32, … 256 (reset when a round pays), then one round drafts
    at the best cap, so the estimates see new evidence. The decision reads only past rounds, never this
    round's draws, so every row stays exact. A fixed γ (or a priced tree) is the user's choice and is never
    overridden.
    """

    def __init__(self):
        self.wait, self.next_wait = 0, FIRST_WAIT

    def admit(self, pacers: list, plans: list[Plan], together: list[bool] | None = None) -> list[Plan]:
        """The plans to run: ``plans`` capped at the best γ, or every row plain this round. ``pacers[b]``,
        ``plans[b]``: row b's pacer and its plan; ``together[b]``: row b drafts with the others that do
        (default: none does)."""
        if len(pacers) < 2 or not any(plan.gamma for plan in plans):
            return plans
        if not all(isinstance(pacer, Auto) for pacer in pacers):
            return plans
        rows, deepest = len(pacers), max(plan.gamma for plan in plans)
        costs, together = pacers[0].costs, together or [False] * rows
        # kept[b][g]: row b's expected kept drafts at γ g
        kept = [[0.0, *itertools.accumulate(pacer.estimate.reach(deepest))] for pacer in pacers]
        rate, cap = max((self._rate(costs, kept, plans, together, g), g) for g in range(1, deepest + 1))
        capped = [plan if plan.gamma <= cap else Plan(cap, plan.keep_above, plan.budget, plan.select)
                  for plan in plans]
        if self.wait > 0:
            self.wait -= 1
            return capped if self.wait == 0 else [_PLAIN] * rows  # the last round of a wait probes
        if rate > (1.0 + MARGIN) * rows / costs.verify_rows(rows, 1):
            self.next_wait = FIRST_WAIT
            return capped
        self.wait, self.next_wait = self.next_wait, min(2 * self.next_wait, MAX_WAIT)
        return [_PLAIN] * rows

    @staticmethod
    def _rate(costs, kept: list[list[float]], plans: list[Plan], together: list[bool], cap: int) -> float:
        """Predicted tokens per second of a round whose every γ is capped at ``cap``."""
        gammas = [min(plan.gamma, cap) for plan in plans]
        tokens = sum(1.0 + row[gamma] for row, gamma in zip(kept, gammas))
        seconds = sum(costs.draft(gamma) for gamma, t in zip(gammas, together) if not t)
        seconds += costs.verify_rows(len(plans), 1 + max(gammas))
        shared = [gamma for gamma, t in zip(gammas, together) if t and gamma]
        if shared:
            seconds += costs.draft(max(shared)) * costs.verify_rows(len(shared), 1) / costs.verify(1)
        return tokens / seconds
