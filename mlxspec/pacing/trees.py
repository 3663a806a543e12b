"""Node budgets of priced trees. EAGLE-2 (arXiv 2406.16858, section 3): a node's path probability approximates
the chance the target accepts it, so the m most probable candidates yield τ(m) ≈ 1 + c · Σ_{i<m} exp(s_i)
tokens (s_i the sorted log path probabilities, c the running ratio of accepted nodes to predicted) in
T_draft + T_verify(m + 1)."""

from __future__ import annotations

import numpy as np

from .costs import Costs


class TreeBudget:
    """The nodes to verify each round (``Plan.budget`` is ``choose``), 0 (a plain step) when no m beats plain.
    Args: ``costs`` (the verify curve), ``max_nodes`` (63, root excluded), ``window`` (32 rounds the
    calibration c remembers), ``prior_weight`` (2 pseudo-nodes behind c = 1), ``allow_plain`` (``True``:
    ``choose`` may return 0)."""

    def __init__(self, costs: Costs, *, max_nodes: int = 63, window: float = 32.0, prior_weight: float = 2.0,
                 allow_plain: bool = True):
        self.costs, self.max_nodes = costs, max_nodes
        self.decay, self.prior = 1.0 - 1.0 / window, prior_weight
        self.allow_plain = allow_plain  # Fixed clears it for a probe round
        self.draft_s, self.predicted, self.accepted = None, 0.0, 0.0
        self.pending, self.said_plain = None, False

    @property
    def calibration(self) -> float:
        """c, accepted nodes per predicted node."""
        return (self.accepted + self.prior) / (self.predicted + self.prior)

    def choose(self, sorted_scores: np.ndarray, draft_s: float) -> int:
        """Nodes to keep given the candidates' log path probabilities best first [C] and this round's drafting
        seconds: 1..C, or 0 with ``allow_plain`` when plain decoding is predicted faster."""
        self.draft_s = draft_s if self.draft_s is None else 0.8 * self.draft_s + 0.2 * draft_s
        scores = np.asarray(sorted_scores[: self.max_nodes], np.float64)
        gain = 1.0 + self.calibration * np.cumsum(np.exp(scores))
        cost = np.array([self.draft_s + self.costs.verify(m + 1) for m in range(1, len(gain) + 1)])
        m = int(np.argmax(gain / cost)) + 1 if len(gain) else 0
        self.said_plain = self.allow_plain and (
            m == 0 or gain[m - 1] / cost[m - 1] <= 1.0 / self.costs.verify(1))
        if self.said_plain:
            self.pending = None
            return 0
        self.pending = float(gain[m - 1] - 1.0) / self.calibration  # Σ exp(s) over the kept nodes
        return m

    def can_win(self, max_depth: int, draft_s: float) -> bool:
        """Whether ``choose`` could ever keep a node: some m beats a plain step with every path probability 1
        (siblings of one distribution sum to at most 1 per depth, so m nodes add at most min(m, ``max_depth``)
        tokens), ``draft_s`` the least a round's drafting costs."""
        nodes = np.arange(1, self.max_nodes + 1)
        cost = draft_s + np.array([self.costs.verify(int(m) + 1) for m in nodes])
        wins = (1.0 + np.minimum(nodes, max_depth)) / cost > 1.0 / self.costs.verify(1)
        return bool(np.any(wins))

    def update(self, num_accepted: int) -> None:
        """Fold in the round ``choose`` sized last: it accepted ``num_accepted`` nodes."""
        if self.pending is None:
            return
        self.predicted = self.predicted * self.decay + self.pending
        self.accepted = self.accepted * self.decay + num_accepted
        self.pending = None
