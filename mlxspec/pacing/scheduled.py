"""Confidence-scheduled verification (DSpark, arXiv 2607.05147; docs/acceptance.md 3.1): a drafter with
survival estimates (``Draft.survival``) drafts its full length and the target verifies the node set S
maximising τ(S) / (T_draft + T_verify(|S| + 1)), τ(S) = 1 + Σ_{n ∈ S} ŝ(n), ŝ the survival recalibrated on
this generation's acceptance (histogram binning, Zadrozny & Elkan 2001). Kept nodes meet the unchanged exact
rule (acceptance.md 3.2)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..drafters.base import Draft, Plan
from ..core.metrics import RoundStats
from .costs import Costs
from .policies import PLAIN

#: Drafted length of a chain drafter under ``scheduled`` when the drafter sizes no rounds itself.
DEFAULT_SCHEDULED_MAX = 8
#: Equal-width bins of predicted survival in the calibration table and the reliability diagram.
NUM_BINS = 10


@dataclass
class SurvivalCalibration:
    """Predicted vs observed survival: the scheduler's recalibration and the reliability diagram.
    ``calibrate`` maps a node's predicted survival s to (kept + w·s) / (seen + w) of its bin (counts decaying
    by ``1 − 1/window`` a round); a node without one (NaN: an EAGLE tree's n-gram branch) gets its depth's
    rate, prior 0.5 a level. ``totals``: undecayed ``"bins"`` and ``"depths"`` tallies, each
    ``[nodes, sum of predicted survival, kept]``."""

    window: float = 64.0
    prior_weight: float = 2.0
    bin_seen: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))
    bin_kept: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))
    depth_seen: list[float] = field(default_factory=list)
    depth_kept: list[float] = field(default_factory=list)
    totals: dict = field(default_factory=lambda: {"bins": [[0, 0.0, 0] for _ in range(NUM_BINS)],
                                                  "depths": []})

    def calibrate(self, survival: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """Recalibrated survival of nodes with raw estimates ``survival`` [N] (NaN = none) at
        ``depths`` [N] (>= 1)."""
        w = self.prior_weight
        bins = _bins(survival)
        out = (self.bin_kept[bins] + w * np.nan_to_num(survival)) / (self.bin_seen[bins] + w)
        for i in np.flatnonzero(np.isnan(survival)):
            d = int(depths[i]) - 1
            seen, kept = (self.depth_seen[d], self.depth_kept[d]) if d < len(self.depth_seen) else (0.0, 0.0)
            out[i] = (kept + w * 0.5 ** (d + 1)) / (seen + w)
        return out

    def observe(self, survival: np.ndarray, depths: np.ndarray, kept: np.ndarray) -> None:
        """Fold in one round's verified nodes: raw survival [N], depths [N] and kept [N] bool."""
        decay, known = 1.0 - 1.0 / self.window, ~np.isnan(survival)
        self.bin_seen, self.bin_kept = self.bin_seen * decay, self.bin_kept * decay
        self.depth_seen = [c * decay for c in self.depth_seen]
        self.depth_kept = [c * decay for c in self.depth_kept]
        np.add.at(self.bin_seen, _bins(survival[known]), 1.0)
        np.add.at(self.bin_kept, _bins(survival[known]), kept[known].astype(float))
        for s, d, k in zip(survival, depths.tolist(), kept.tolist()):
            if np.isnan(s):
                self.depth_seen += [0.0] * max(d - len(self.depth_seen), 0)
                self.depth_kept += [0.0] * max(d - len(self.depth_kept), 0)
                self.depth_seen[d - 1] += 1.0
                self.depth_kept[d - 1] += k
                continue
            self.totals["depths"] += [[0, 0.0, 0] for _ in range(d - len(self.totals["depths"]))]
            for tally in (self.totals["bins"][int(_bins(np.array([s]))[0])], self.totals["depths"][d - 1]):
                tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + float(s), tally[2] + int(k)


def _bins(survival: np.ndarray) -> np.ndarray:
    return np.clip((np.nan_to_num(survival) * NUM_BINS).astype(int), 0, NUM_BINS - 1)


def closed_survival(calibrated: np.ndarray, tree) -> np.ndarray:
    """``calibrated`` [N] made non-increasing from each node to its children and later siblings.

    Then the best m nodes by (value, index) always include each kept node's parent and earlier
    siblings, so the kept set is a tree whose sibling lists are prefixes in draw order: dropping a
    later sibling leaves the earlier siblings' q (drawn before it) exact (docs/acceptance.md 3.2).
    """
    out = calibrated.astype(np.float64).copy()
    previous: dict[int, int] = {}  # parent -> its latest child so far
    for n, parent in enumerate(tree.parents):
        # the parent, the previous sibling
        for above in (parent if parent >= 0 else None, previous.get(parent)):
            out[n] = out[n] if above is None else min(out[n], out[above])
        previous[parent] = n
    return out


def best_count(values: np.ndarray, costs: Costs, spent_s: float) -> int:
    """m in 0..N maximising (1 + Σ_{i<m} values[i]) / (spent_s + T_verify(m + 1));
    ``values`` [N] best first."""
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(values)])  # [N + 1]: τ(m)
    cost = np.array([spent_s + costs.verify(m + 1) for m in range(len(values) + 1)])
    return int(np.argmax(gain / cost))


def stopping_length(values: np.ndarray, costs: Costs, spent_s: float) -> int:
    """Positions of a chain to verify (0..K), decided position by position: i is verified when some m >= i
    predicts more tokens/s than stopping before i, reading ``values[:i + 1]`` [K] only (continued
    geometrically), so a sampled chain's decision never depends on the token it decides about
    (docs/acceptance.md 3.2)."""
    K, tau = len(values), 1.0
    for i in range(K):
        ratio = values[i] / values[i - 1] if i and values[i - 1] > 0 else values[i]
        ahead = tau + np.cumsum(values[i] * ratio ** np.arange(K - i))  # τ through positions i..K-1
        cost = np.array([spent_s + costs.verify(m + 2) for m in range(i, K)])
        if np.max(ahead / cost) <= tau / (spent_s + costs.verify(i + 1)):
            return i
        tau += values[i]
    return K


class Scheduled:
    """``--num-draft-tokens scheduled``: draft the full length, verify the best predicted
    part (``Plan.select``).

    When even the best m is predicted slower than plain decoding, the next ``probe_every`` (16) rounds are
    plain; the first drafting round, and the first after a pause, verifies the whole draft, so the
    recalibration sees every position. ``max_gamma``: the depth drafted (default 8). Raises ``ValueError``
    for ``max_gamma < 1``.
    """

    adaptive = True
    priced_out = False  # it prices each draft as it comes (``schedule``), never the drafter as a whole

    def __init__(self, costs: Costs, *, max_gamma: int = DEFAULT_SCHEDULED_MAX, probe_every: int = 16,
                 calibration: SurvivalCalibration | None = None):
        if max_gamma < 1:
            raise ValueError(f"the scheduled draft length must be >= 1, got {max_gamma}")
        self.costs, self.max_gamma, self.probe_every = costs, max_gamma, probe_every
        self.calibration = calibration or SurvivalCalibration()
        self.kept_nodes, self.predicted_speedup = 0, 1.0
        self._plain_left, self._pending, self._probe = 0, None, True

    def plan(self) -> Plan:
        """Draft ``max_gamma`` and verify what ``schedule`` keeps, or a plain step while pausing."""
        self.kept_nodes, self._pending = 0, None
        if self._plain_left > 0:
            self._plain_left -= 1
            self._probe = self._plain_left == 0
            return PLAIN
        return Plan(self.max_gamma, select=self.schedule)

    def schedule(self, draft: Draft) -> Draft:
        """The part of ``draft`` to verify: the best m nodes of a deterministic draft, a sampled chain cut by
        ``stopping_length``, a sampled tree or a draft without survival whole. Reads
        ``draft.survival`` on the host."""
        sampled = draft.logprobs is not None
        if draft.size == 0 or draft.survival is None or (sampled and not draft.tree.is_chain):
            self.kept_nodes = draft.size
            return draft
        raw = np.array(draft.survival, dtype=np.float64)  # the host read scheduling costs
        depths = draft.tree.depths[1:]
        value = closed_survival(self.calibration.calibrate(raw, depths), draft.tree)
        spent = self.costs.draft(int(depths.max()))
        if sampled:
            m = stopping_length(value, self.costs, spent)
            nodes = list(range(m))
        else:  # the best m by calibrated survival
            order = sorted(range(draft.size), key=lambda n: (-value[n], n))
            m = best_count(value[order], self.costs, spent)
            nodes = sorted(order[:m])
        tau = 1.0 + float(value[nodes].sum())
        self.predicted_speedup = tau * self.costs.verify(1) / (spent + self.costs.verify(m + 1))
        if self.predicted_speedup <= 1.0 and self.probe_every > 0:
            self._plain_left = self.probe_every
        if self._probe:  # decided before the draft was seen, so exact for any draft
            m, nodes, self._probe = draft.size, list(range(draft.size)), False
        self._pending, self.kept_nodes = (raw[nodes], depths[nodes]), m
        return draft.select(nodes)

    def observe(self, outcome: RoundStats, draft: Draft | None = None) -> None:
        """Learn the costs, and which verified nodes were on the accepted path (``outcome.path``)."""
        self.costs.observe(outcome)
        if self._pending is None or not self.kept_nodes:
            return
        (raw, depths), kept, self._pending = self._pending, np.zeros(len(self._pending[0]), dtype=bool), None
        kept[list(outcome.path)] = True
        self.calibration.observe(raw, depths, kept)
