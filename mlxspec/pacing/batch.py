"""Pacing for a batch: whether this round's drafts pay at this batch size, decided before anything is
drafted."""

from __future__ import annotations

from ..drafters.base import Plan
from .policies import FIRST_WAIT, MAX_WAIT, Auto

#: The predicted gain a speculative batch round needs over a plain batched step (as ``Auto``'s margin).
MARGIN = 0.03
_PLAIN = Plan(0)


class BatchGate:
    """With every row on γ auto, a round verifies R rows × k tokens in one forward, k = 1 + the widest row's
    γ (rows are padded to it). It is priced on the measured cost of that forward (``Costs.verify_rows``):
    the expected tokens Σ_r τ_r (each row's own acceptance estimate) per second of drafting plus that forward,
    against R tokens per ``verify_rows(R, 1)``, a plain batched step. Rows drafting ``together`` (one draft
    forward per token for all: ``engine/batch_draft.py``) cost one row's drafting of their deepest γ, scaled
    as the target's forward over as many rows. When the drafts do not pay by ``MARGIN``, the batch decodes
    plainly for 16 rounds, then 32, … 256 (reset when one pays), then lets one round draft as planned, so the
    estimates see new evidence. The decision reads only past rounds, never this round's draws, so every row
    stays exact. A fixed γ (or a priced tree) is the user's choice and is never overridden.
    """

    def __init__(self):
        self.wait, self.next_wait = 0, FIRST_WAIT

    def admit(self, pacers: list, plans: list[Plan], together: list[bool] | None = None) -> list[Plan]:
        """The plans to run: ``plans``, or every row plain this round. ``pacers[b]``, ``plans[b]``: row b's
        pacer and its plan; ``together[b]``: row b drafts with the others that do (default: none does)."""
        if len(pacers) < 2 or not any(plan.gamma for plan in plans):
            return plans
        if not all(isinstance(pacer, Auto) for pacer in pacers):
            return plans
        if self.wait > 0:
            self.wait -= 1
            return plans if self.wait == 0 else [_PLAIN] * len(plans)  # the last round of a wait probes
        costs, rows = pacers[0].costs, len(pacers)
        tokens = sum(
            1.0 + sum(pacer.estimate.reach(plan.gamma)[: plan.gamma]) for pacer, plan in zip(pacers, plans)
        )
        together = together or [False] * rows
        shared = [plan.gamma for plan, t in zip(plans, together) if t and plan.gamma]
        seconds = sum(costs.draft(plan.gamma) for plan, t in zip(plans, together) if not t)
        seconds += costs.verify_rows(rows, 1 + max(plan.gamma for plan in plans))
        if shared:
            seconds += costs.draft(max(shared)) * costs.verify_rows(len(shared), 1) / costs.verify(1)
        if tokens / seconds > (1.0 + MARGIN) * rows / costs.verify_rows(rows, 1):
            self.next_wait = FIRST_WAIT
            return plans
        self.wait, self.next_wait = self.next_wait, min(2 * self.next_wait, MAX_WAIT)
        return [_PLAIN] * rows
