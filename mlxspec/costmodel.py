"""Measured costs, predicted speedup, and the automatic draft length γ.

Leviathan et al. 2023 (arXiv 2211.17192), section 3: with acceptance rate α a round
of γ drafts yields τ(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens on average, so

    speedup(γ) = τ(α, γ) · T_target(1) / (γ · T_draft + T_verify(γ + 1)).

Both costs are *measured* on this machine (``calibration.calibrate_verify``,
``calibrate_draft``) and cached per model and machine under ``$MLXSPEC_CACHE/costs`` (default
``~/.cache/mlxspec/costs``): the same model verifies 8 tokens for 1.8x one step on
one machine and 7x on another, so no constant is right everywhere.

``AutoGamma`` is what ``--num-draft-tokens auto`` runs: before each round it picks
the γ with the best predicted speedup from a running, per-depth estimate of
acceptance, and γ = 0 (plain decoding) when speculation is predicted to lose.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

#: Largest verify width calibrated (γ + 1 ≤ this, so γ ≤ 15).
MAX_VERIFY_TOKENS = 16
#: Context the costs are measured at (attention cost grows with it).
DEFAULT_CONTEXT_TOKENS = 256


# ---------------------------------------------------------------- prediction


def expected_tau(alpha: float, gamma: int) -> float:
    """τ = (1 − α^(γ+1)) / (1 − α): expected tokens per round (Leviathan et al. 2023, eq. 1)."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def tau_from_reach(reach: list[float], gamma: int) -> float:
    """Expected tokens per round from per-depth reach probabilities: τ = 1 + Σ_{i<γ} reach[i].

    ``reach[i]`` = P(the draft at depth i + 1 is kept | a draft was proposed there), which
    makes τ exact without assuming independent positions; beyond the list, reach decays
    geometrically by its last ratio. With ``reach[i] = α^(i+1)`` this is ``expected_tau(α, γ)``.
    """
    if gamma <= 0 or not reach:
        return 1.0
    ratio = reach[-1] / reach[-2] if len(reach) > 1 and reach[-2] > 0 else reach[0]
    values = list(reach[:gamma])
    while len(values) < gamma:
        values.append(values[-1] * ratio)
    return 1.0 + sum(values)


@dataclass
class Costs:
    """Measured costs of one target (+ one drafter) on one machine.

    Attributes:
        verify_s: ``[k - 1]`` = seconds for one target forward over k tokens with the
            host read that ends a round, k = 1..16 (interpolated between ``calibration.VERIFY_GRID``
            points, non-decreasing). ``verify_s[0]`` is T_target(1), a plain step.
        draft_s: Seconds per drafted token (0 for a drafter that costs nothing measurable).
        context_tokens: Cache length the costs were measured at.
        draft_round_s: Seconds of drafting per round that drafts at all, whatever its length: a block
            drafter's one forward (``Drafter.fixed_round_cost``: DFlash, DSpark). 0 for the others.
    """

    verify_s: list[float]
    draft_s: float = 0.0
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    draft_round_s: float = 0.0

    def verify(self, num_tokens: int) -> float:
        """T_verify(k) in seconds; beyond the measured range, extrapolated linearly."""
        n = len(self.verify_s)
        if num_tokens <= n:
            return self.verify_s[max(num_tokens, 1) - 1]
        slope = (self.verify_s[-1] - self.verify_s[0]) / max(n - 1, 1)
        return self.verify_s[-1] + slope * (num_tokens - n)

    def draft(self, gamma: int) -> float:
        """Predicted seconds of drafting for a round of depth γ: ``draft_round_s`` (if γ ≥ 1) + γ · ``draft_s``."""
        return (self.draft_round_s if gamma > 0 else 0.0) + gamma * self.draft_s

    def round_s(self, gamma: int, nodes: Callable[[int], int] | None = None) -> float:
        """Predicted seconds for one round: T_draft(γ) (``draft``) + T_verify(nodes(γ) + 1).

        ``nodes``: the draft nodes a round of depth γ sends to the target (a tree's, ``Drafter.round_nodes``);
        ``None``: γ, a chain."""
        return self.draft(gamma) + self.verify((nodes(gamma) if nodes is not None else gamma) + 1)

    def speedup(self, gamma: int, alpha: float | list[float], nodes: Callable[[int], int] | None = None) -> float:
        """Predicted speedup over plain decoding at draft length (depth) γ.

        Args:
            gamma: Draft length γ; 0 gives exactly 1.
            alpha: Acceptance rate α, or per-depth reach probabilities (see ``tau_from_reach``).
            nodes: As ``round_s``.
        """
        tau = expected_tau(alpha, gamma) if isinstance(alpha, (int, float)) else tau_from_reach(alpha, gamma)
        return tau * self.verify(1) / self.round_s(gamma, nodes)

    def best_gamma(self, alpha: float | list[float], max_gamma: int, margin: float = 0.0,
                   nodes: Callable[[int], int] | None = None) -> tuple[int, float]:
        """The γ in 0..max_gamma with the best predicted speedup, and that speedup (``nodes``: as ``round_s``).

        γ = 0 (plain decoding, speedup 1) wins unless some γ beats it by more than ``margin``.
        """
        best = max(range(1, max_gamma + 1), key=lambda g: self.speedup(g, alpha, nodes), default=0)
        speedup = self.speedup(best, alpha, nodes) if best else 1.0
        return (best, speedup) if speedup > 1.0 + margin else (0, 1.0)


# ---------------------------------------------------------------- running acceptance


@dataclass
class AcceptanceEstimate:
    """Running per-depth acceptance with exponential forgetting, as a product of conditional survivals.

    A round that drafted K tokens and kept n adds, at each depth i < K, one draft, (if i < n) one keep,
    and (if i <= n) one *reach*: the draft there was judged, its parent being kept. ``reach(m)`` is
    P(depth i kept) = α · h_2 · … · h_i, h_i = keeps / reaches at depth i (the product-limit, Kaplan–Meier,
    estimate: drafts behind a rejection were never judged and count at no depth), each h_i shrunk toward
    the pooled h of all deeper depths, itself shrunk toward α. So a depth no round reached continues the
    chains measured, and one rejection behind a long draft does not make every deeper depth look rejected,
    as the per-depth ratio this replaced did (docs/results-archive.md, run X). Counts decay by ``1 − 1/window``
    per drafting round, so the estimate follows α as it moves.

    Attributes:
        prior_alpha: α assumed before any round. Default: ``0.5``.
        prior_weight: Pseudo-rounds behind the prior. Default: ``2``.
        window: Rounds the memory spans (decay time constant). Default: ``16`` (32 was slower to follow
            a drafter whose acceptance moves within an answer, in the replays ``AutoGamma`` names).
        pool_weight: Pseudo-reaches behind α in the pooled conditional survival. Default: ``8`` (replayed
            in run X: 2 favoured lookups more and cost a paid drafter whose acceptance comes in bursts 2%;
            16 the reverse).
        drafted, kept, reached: Decayed counts per depth (``reached[0]`` = ``drafted[0]``).
        rounds: Drafting rounds folded in, not decayed: how much has been measured in all.
    """

    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    window: float = 16.0
    pool_weight: float = 8.0
    drafted: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    rounds: int = 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Fold in one round (nothing happens for a round without drafts)."""
        self.update_kept([float(i < num_accepted) for i in range(num_drafted)])

    def update_kept(self, kept: list[float]) -> None:
        """Fold in one round that drafted ``len(kept)`` tokens, ``kept[i]`` the probability (or 0/1 outcome)
        that depth i + 1 was kept (non-increasing); nothing happens for an empty list. Depth i + 1 was
        reached (judged) with the probability that depth i was kept."""
        if not kept:
            return
        self.rounds += 1
        decay = 1.0 - 1.0 / self.window
        counts = (self.drafted, self.kept, self.reached)
        for c in counts:
            c[:] = [v * decay for v in c] + [0.0] * max(0, len(kept) - len(c))
        for i, k in enumerate(kept):
            self.drafted[i] += 1.0
            self.kept[i] += k
            self.reached[i] += 1.0 if i == 0 else kept[i - 1]

    @property
    def alpha(self) -> float:
        """Acceptance at the first depth, shrunk to the prior."""
        drafted, kept = (self.drafted[0], self.kept[0]) if self.drafted else (0.0, 0.0)
        return (kept + self.prior_weight * self.prior_alpha) / (drafted + self.prior_weight)

    def reach(self, num_depths: int) -> list[float]:
        """``[i]`` = estimated P(the draft at depth i + 1 is kept), non-increasing in i."""
        alpha, w = self.alpha, self.prior_weight
        pooled = (sum(self.kept[1:]) + self.pool_weight * alpha) / (sum(self.reached[1:]) + self.pool_weight)
        out, above = [], 1.0
        for i in range(num_depths):
            kept = self.kept[i] if i < len(self.kept) else 0.0
            reached = self.reached[i] if i < len(self.reached) else 0.0
            above *= (kept + w * (alpha if i == 0 else pooled)) / (reached + w)  # depth 1: shrunk toward α once more
            out.append(above)
        return out


# ---------------------------------------------------------------- automatic γ


class TreeBudget:
    """How many draft nodes to verify this round, from measured costs (``total_tokens="auto"``).

    EAGLE-2 (arXiv 2406.16858, section 3) observes that a node's cumulative draft probability
    (the product of the draft's confidences along its path) approximates the chance that the
    target accepts it. Keeping the m most probable candidates therefore yields
    τ(m) ≈ 1 + c · Σ_{i<m} exp(s_i) tokens per round, where s_i are the sorted cumulative draft
    log-probabilities and c corrects the draft's calibration: the running ratio of accepted
    nodes to the sum exp(s_i) predicted for the nodes kept, over recent rounds. A round costs
    T_draft + T_verify(m + 1) (``costmodel.Costs``, measured on this machine), so the budget is
    the m with the most tokens per second, τ(m) / (T_draft + T_verify(m + 1)), at least 1 node.

    With ``allow_plain`` the budget may be 0 nodes: a plain step (1 token in T_verify(1)) when no
    m is predicted to give more tokens per second than that.

    Args:
        costs: The target's measured ``Costs`` (its verify curve; extrapolated past 16 tokens).
        max_nodes: Most draft nodes kept (root excluded). Default: ``63``.
        window: Rounds the calibration remembers (exponential forgetting). Default: ``32``.
        prior_weight: Pseudo-nodes behind the prior calibration c = 1. Default: ``2``.
        allow_plain: Whether ``choose`` may return 0. Default: ``False``.

    Attributes:
        draft_s: Running estimate of one round's draft time, seconds.
        calibration: c, accepted nodes per predicted node.
    """

    def __init__(self, costs, *, max_nodes: int = 63, window: float = 32.0, prior_weight: float = 2.0,
                 allow_plain: bool = False):
        self.costs, self.max_nodes, self.decay, self.prior = costs, max_nodes, 1.0 - 1.0 / window, prior_weight
        self.allow_plain = allow_plain
        self.draft_s, self.predicted, self.accepted, self.pending = None, 0.0, 0.0, None

    @property
    def calibration(self) -> float:
        return (self.accepted + self.prior) / (self.predicted + self.prior)

    def choose(self, sorted_scores: np.ndarray, draft_s: float) -> int:
        """Nodes to keep (1 <= m <= len(sorted_scores); 0 with ``allow_plain``) given the candidates'
        log scores (cumulative draft log-probabilities), best first, shape [C]; ``draft_s`` is this
        round's draft time in seconds."""
        self.draft_s = draft_s if self.draft_s is None else 0.8 * self.draft_s + 0.2 * draft_s
        gain = 1.0 + self.calibration * np.cumsum(np.exp(sorted_scores[: self.max_nodes].astype(np.float64)))
        cost = np.array([self.draft_s + self.costs.verify(m + 1) for m in range(1, len(gain) + 1)])
        m = int(np.argmax(gain / cost)) + 1 if len(gain) else 0
        # plain decoding makes 1 token per T_verify(1) and drafts nothing
        if self.allow_plain and (m == 0 or gain[m - 1] / cost[m - 1] <= 1.0 / self.costs.verify(1)):
            self.pending = None
            return 0
        self.pending = float(gain[m - 1] - 1.0) / self.calibration  # Σ exp(s) over the kept nodes
        return m

    def can_win(self, max_depth: int, draft_s: float) -> bool:
        """Whether ``choose`` could ever keep a node, before any round: some m predicted to beat a plain step
        even if every path probability were 1.

        The path probabilities of a tree whose siblings are distinct tokens of one distribution sum to at
        most 1 per depth, so with the prior calibration c = 1 (which no round changes while nothing is
        drafted) m nodes predict at most 1 + min(m, ``max_depth``) tokens, in ``draft_s`` + T_verify(m + 1)
        seconds. Always ``True`` without ``allow_plain``.

        Args:
            max_depth: The tree's depth.
            draft_s: The least a round's drafting costs here, seconds.
        """
        if not self.allow_plain:
            return True
        nodes = np.arange(1, self.max_nodes + 1)
        cost = draft_s + np.array([self.costs.verify(int(m) + 1) for m in nodes])
        return bool(np.any((1.0 + np.minimum(nodes, max_depth)) / cost > 1.0 / self.costs.verify(1)))

    def update(self, num_accepted: int) -> None:
        """Fold in the round whose budget ``choose`` set last: it accepted ``num_accepted`` nodes."""
        if self.pending is None:
            return
        self.predicted = self.predicted * self.decay + self.pending
        self.accepted = self.accepted * self.decay + num_accepted
        self.pending = None


class AutoGamma:
    """Picks γ before every round from measured costs and running acceptance.

    The loop calls ``choose_gamma()`` before each propose and ``update(cycle_stats)``
    after each round. γ = 0 means the round is plain decoding. Each round takes the γ with the best
    predicted speedup at the estimated acceptance. When none is predicted to win:

    - before any drafting round (only the prior α says no) while the costs allow a win, the first round
      is a probe instead: a costly draft model that agrees 90% of the time would otherwise wait
      ``probe_every`` plain rounds before its first chance;
    - while the evidence is too thin to give up (an optimistic α, the estimate plus ``optimism`` standard
      errors over the rounds measured so far, would still win), the round drafts the fewest tokens that would win at
      that α (1 for a drafter that pays per token), the cheapest round that measures α: a draft model
      near break-even (costing half a target step, kept 60–80% of the time) swings across the line on a
      few rejections, and a fall-back learns nothing while it waits;
    - otherwise it falls back to plain decoding.

    It also falls back, whatever the prediction, on a run of drafting rounds that kept nothing which
    is improbable at the estimated acceptance, (1 − α̂)^misses < ``miss_p`` (a drafter that stopped
    matching, found within two or three rounds where it used to keep 90%; a drafter kept half the
    time is allowed its chance runs of misses), or that reaches ``miss_rounds`` (a drafter that
    proposes every round and is almost never right, whose estimate sinks with each miss so that no
    run looks improbable). While falling back nothing is learned, so after a wait
    a short probe (``probe_gamma`` tokens) re-measures α (a probe whose drafter proposed nothing, as a
    lookup that found no match, is made again the next round); each probe that keeps nothing doubles
    the wait (exponential back-off: ``probe_every``, 2×, 4×, ... up to ``max_wait`` plain rounds), and
    one that keeps a token resets it. No probe is made when the costs alone rule speculation out (it
    would lose even if every draft were accepted). Plain rounds teach it nothing, so the loop may ask
    for the next γ before reporting a plain round (it pipelines consecutive plain steps).

    With ``judges`` (``Drafter.judge``: the draft model) a wait ends in a judgement, not a probe: the round
    stays plain and sets ``judging``, the loop hands the drafter's teacher-forced acceptance of the plain
    stretch to ``observe``, and the next choice is made on it as on any other evidence. A probe measures one
    or two positions; a judgement up to 32 tokens of the stretch, in the catch-up forward the draft makes anyway.

    With ``stop_early`` (a drafter that drafts token by token and can stop on its own confidence,
    ``Drafter.stops_early``: the draft model), whether a round drafts is priced at one token (the
    first draft must pay for itself at the estimated α), a round that drafts is given ``max_gamma``,
    and the drafter stops as soon as the next token would not pay (``keep_drafting``): γ follows the
    draft's confidence position by position instead of the running mean.

    The defaults were chosen by replaying the policy, at temperature 0, on Qwen2.5-Coder-1.5B's greedy
    answers with its 0.5B draft model and with n-gram lookup, and on synthetic acceptance sequences
    (docs/results-archive.md, run Q).

    Args:
        costs: This machine's ``Costs`` for the target and drafter.
        max_gamma: Largest γ considered. Default: ``15`` (verify width 16, the calibrated range).
        margin: Predicted gain a γ > 0 needs over plain decoding. Default: ``0.03``.
        probe_every: Plain rounds before the first probe of a fall-back. Default: ``16``.
        probe_gamma: γ of a probe. Default: ``2``.
        estimate: Acceptance estimate to start from. Default: a fresh one (prior α = 0.5).
        miss_p: A run of misses less probable than this at the estimated acceptance falls back.
            Default: ``0.02``.
        miss_rounds: A run of this many misses falls back whatever the estimate. Default: ``8``.
        max_wait: Longest wait between probes, in plain rounds. Default: ``256``.
        nodes: Draft nodes a round of depth γ sends to the target (``Drafter.round_nodes``: a tree
            verifies more nodes than its depth), priced in every choice. Default: γ (a chain).
        optimism: Standard errors above the estimated α at which a round still drafts (the fewest tokens that
            would win there) rather than fall back. Default: ``1.5``; ``0`` falls back on the estimate alone.
        stop_early: Price rounds at one token and let the drafter stop each round early (``keep_drafting``).
            Default: ``False``.
        judges: End waits in a judgement of the plain stretch (``observe``) instead of a probe round.
            Default: ``False``.

    Attributes:
        gamma: γ chosen for the current round.
        predicted_speedup: Predicted speedup of that choice (1 when falling back or probing).
        probing: Whether the current round is a probe.
        judging: Whether the loop should hand ``observe`` the drafter's judgement of the plain stretch.

    Raises:
        ValueError: ``max_gamma``, ``probe_every`` or ``miss_rounds`` below 1, ``miss_p`` outside (0, 1] or
            ``optimism < 0``.
    """

    #: The per-round choices are recorded in the stats (``GenerationStats.gamma_rounds``).
    adaptive = True

    def __init__(self, costs: Costs, *, max_gamma: int = MAX_VERIFY_TOKENS - 1, margin: float = 0.03,
                 probe_every: int = 16, probe_gamma: int = 2, estimate: AcceptanceEstimate | None = None,
                 miss_p: float = 0.02, miss_rounds: int = 8, max_wait: int = 256,
                 nodes: Callable[[int], int] | None = None, optimism: float = 1.5, stop_early: bool = False,
                 judges: bool = False):
        if min(max_gamma, probe_every, miss_rounds) < 1:
            raise ValueError(f"max_gamma, probe_every and miss_rounds must be >= 1, got {max_gamma}, {probe_every} "
                             f"and {miss_rounds}")
        if not 0.0 < miss_p <= 1.0 or optimism < 0:
            raise ValueError(f"miss_p must be in (0, 1] and optimism >= 0, got {miss_p} and {optimism}")
        self.costs, self.max_gamma, self.margin, self.nodes = costs, max_gamma, margin, nodes
        self.probe_every, self.probe_gamma = probe_every, min(probe_gamma, max_gamma)
        self.miss_p, self.miss_rounds, self.optimism = miss_p, miss_rounds, optimism
        self.stop_early, self.judges, self.judging, self._blind = stop_early, judges, False, False  # _blind: probe
        self._priced = 1 if stop_early else max_gamma  # deepest round a choice is priced at
        # stop_early: the survivals keep_drafting was told this round, and decayed kept / told sums behind
        # ``survival_calibration`` (prior: 2 tokens, calibrated)
        self._told: list[float] = []
        self._kept_told, self._sum_told = 2.0, 2.0
        self.max_wait = max(max_wait, probe_every)
        self.estimate = estimate or AcceptanceEstimate()
        self.can_win = costs.best_gamma(1.0, max_gamma, margin, nodes)[0] > 0
        self.gamma, self.predicted_speedup, self.probing = 0, 1.0, False
        self._wait = 0  # plain rounds left before the next probe
        self._probe_due = False
        self._interval = probe_every  # the wait after the next miss
        self._misses = 0  # drafting rounds in a row that kept nothing

    def choose_gamma(self) -> int:
        """γ for the next round (0 = plain decoding)."""
        self.probing, self.predicted_speedup, self._told = False, 1.0, []
        if self._wait > 0:
            self._wait, self.gamma = self._wait - 1, 0
            return 0
        if self._probe_due:
            self._probe_due, self.probing = False, self.can_win
            if self.probing and self.judges and not self._blind:  # the stretch is judged (observe), the round plain
                self.probing, self.judging, self.gamma = False, True, 0
                return 0
            self._blind = False
            if self.probing:
                self.gamma = self.max_gamma if self.stop_early else self.probe_gamma
                return self.gamma
        reach = self.estimate.reach(self._priced)
        self.gamma, self.predicted_speedup = self.costs.best_gamma(reach, self._priced, self.margin, self.nodes)
        if self.gamma == 0 and self.can_win and not self.estimate.drafted:
            self.gamma, self.probing = self.probe_gamma, True  # only the prior says no: measure first
        elif self.gamma == 0 and self.can_win:
            self.gamma = self._exploring_gamma()  # too little evidence to give up: the cheapest round that wins
            if self.gamma == 0:
                self._back_off()
        elif self.gamma == 0:
            self._back_off()
        if self.stop_early and self.gamma > 0:
            self.gamma = self.max_gamma  # the drafter's confidence ends the round (keep_drafting)
        return self.gamma

    def observe(self, acceptances: list[float] | None) -> None:
        """Fold in the drafter's judgement of consecutive tokens decoded plainly (``judging``; ``Drafter.judge``).

        ``acceptances[i]``: the estimated probability that a draft at the i-th token would have been kept
        (0 or 1 at temperature 0). Each token counts as a round drafted from there, depth d kept with the
        product of the d acceptances from it (along the committed text), so 16 tokens weigh as 16 rounds.
        A judgement that predicts a win resets the back-off, as a probe that keeps a token does.
        ``None`` or an empty list (the drafter could not judge): the next round is a probe.
        """
        self.judging = False
        if not acceptances:
            self._probe_due, self._blind = True, True
            return
        for i in range(len(acceptances)):
            kept, run = [], 1.0
            for a in acceptances[i : i + self._priced]:
                run *= min(max(float(a), 0.0), 1.0)
                kept.append(run)
            self.estimate.update_kept(kept)
        if self.costs.best_gamma(self.estimate.reach(self._priced), self._priced, self.margin, self.nodes)[0] > 0:
            self._interval, self._misses = self.probe_every, 0

    def keep_drafting(self, drafted: int, survival: float) -> bool:
        """With ``stop_early``: whether the drafter drafts one more token after ``drafted`` (>= 1) this round.

        The next token is kept only if every token before it is, which the drafter puts at ``survival`` (the
        product of its confidences so far, in [0, 1]), scaled down by ``survival_calibration`` when the
        drafter has been over-confident; so it adds at most s = ``survival`` · calibration tokens to the
        round, worth s · T_verify(1) seconds at plain decoding's rate, and costs
        T_draft(1) + T_verify(drafted + 2) − T_verify(drafted + 1). It is drafted while it pays that.
        """
        self._told.append(survival)
        extra = self.costs.draft_s + self.costs.verify(drafted + 2) - self.costs.verify(drafted + 1)
        return survival * self.survival_calibration * self.costs.verify(1) > extra

    @property
    def survival_calibration(self) -> float:
        """With ``stop_early``: drafted tokens kept per unit of survival the drafter claimed for them (the
        survivals ``keep_drafting`` was told), over the rounds the estimate remembers, capped at 1: a drafter
        whose confidence says 0.9 where 0.6 is kept drafts as deep as a calibrated 0.6 would, while an
        under-confident one is taken at its word (its stops are safe). Prior: 2 tokens, calibrated."""
        return min(1.0, self._kept_told / self._sum_told)

    def _exploring_gamma(self) -> int:
        """The smallest γ predicted to win on an optimistic reach (the depth-1 estimate raised by ``optimism``
        standard errors over every round measured so far, deeper depths by that factor per level), 0 if none: 1
        for a drafter that pays per token, more for one that pays per round. The error shrinks with the rounds measured in
        all, not the remembered ones, so a drafter steadily just under break-even stops being explored."""
        reach = self.estimate.reach(self._priced)
        error = math.sqrt(reach[0] * (1.0 - reach[0]) / (self.estimate.rounds + self.estimate.prior_weight))
        ratio = min(1.0, reach[0] + self.optimism * error) / reach[0] if reach[0] > 0 else 1.0
        optimistic, above = [], 1.0
        for i, r in enumerate(reach):  # depth i + 1 scaled as a geometric chain at the optimistic α would be
            above = min(above, r * ratio ** (i + 1))
            optimistic.append(above)
        return next((g for g in range(1, self._priced + 1)
                     if self.costs.speedup(g, optimistic, self.nodes) > 1.0 + self.margin), 0)

    def update(self, cycle) -> None:
        """Learn from one round's ``CycleStats`` (its depth, or ``num_drafted``, and ``num_accepted``)."""
        drafted = getattr(cycle, "depth", 0) or cycle.num_drafted
        if self._told:  # token j of the round, whose survival keep_drafting was told, was kept iff j <= accepted
            decay = 1.0 - 1.0 / self.estimate.window
            self._kept_told = self._kept_told * decay + min(cycle.num_accepted, len(self._told))
            self._sum_told = self._sum_told * decay + sum(self._told)
            self._told = []
        if drafted <= 0:
            if self.probing:  # a lookup found nothing to draft: the probe tested nothing, so the next round probes
                self._probe_due = True
            return
        self.estimate.update(drafted, cycle.num_accepted)
        if cycle.num_accepted > 0:
            self._misses, self._interval = 0, self.probe_every
            return
        self._misses += 1
        alpha = self.estimate.reach(1)[0]
        if self.probing or self._misses >= self.miss_rounds or (1.0 - alpha) ** self._misses < self.miss_p:
            self._back_off()

    def _back_off(self) -> None:
        self._wait, self._interval = self._interval, min(2 * self._interval, self.max_wait)
        self._misses, self._probe_due = 0, True
