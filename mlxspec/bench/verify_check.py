"""A losslessness check of speculative decoding on a real target and drafter (``mlxspec verify``).

Speculative decoding with exact rejection sampling is distributed exactly as the target
(Leviathan et al. 2023, arXiv 2211.17192, theorem 1; Chen et al. 2023, arXiv 2302.01318). This
module tests that claim for a user's own setup: it samples the first K tokens N times through the
engine's acceptance rule, enumerates the target's own warped next-token distribution at every
prefix it saw often enough, and runs a G-test (Sokal & Rohlf; the log-likelihood ratio of the
multinomial) with rare cells pooled. The joint of K tokens factorises into next-token conditionals,
so the per-prefix statistics add up (as do their degrees of freedom) to one statistic per prompt;
prompts are corrected for multiple testing with Holm's step-down method (Holm 1979). At
temperature 0 the check is token-for-token equality with mlx-lm's plain greedy decoding.

Batching: for a drafter whose proposals depend on the committed tokens only (no per-sequence state
in ``prefill``/``commit``, no device work: ``none``, ``ngram``), samples that reach the same
prefix share one draft and one target forward, and only the acceptance draws are made per sample,
so 2,000 samples cost a few hundred forwards. Any other drafter runs every sample through the
engine's own round loop (``generate.speculative_rounds``), prompt prefill included.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..core.cache import prefill, tree_attention
from ..drafters import Draft, Drafter
from ..pacing import Fixed, Pacer
from ..engine.generate import make_verifier, speculative_rounds
from ..core.sampling import SamplingParams, process_logits, warp
from ..core.tree import Tree

DEFAULT_SAMPLES = 2000
DEFAULT_TOKENS = 3
#: Most tokens per sampled sequence (``--tokens``). Token k is tested only at prefixes that at least
#: ``MIN_PREFIX_SAMPLES`` samples reach, which past a few tokens are none but on near-deterministic text,
#: while
#: the time grows with samples × tokens: 2,000 samples of 64 tokens are already 128,000 sampled tokens.
MAX_TOKENS = 64
DEFAULT_ALPHA = 0.01
#: Cells expected to hold fewer samples are pooled (the usual rule for the chi-square approximation).
MIN_EXPECTED = 5.0
#: A prefix reached by fewer samples is not tested on its own (it has almost no power).
MIN_PREFIX_SAMPLES = 20
#: Acceptance draws evaluated per sync in the batched path.
DRAWS_PER_EVAL = 128
DEFAULT_PROMPTS = (
    "Write the numbers from 1 to 20, separated by commas.",
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
)


@dataclass
class PromptCheck:
    """The verdict for one prompt.

    Attributes:
        prompt: The prompt text.
        samples: Sequences sampled (0 at temperature 0).
        statistic: G summed over the tested prefixes (``inf`` when a token outside the target's
            support was emitted); 0 at temperature 0.
        df: Its degrees of freedom.
        p_value: P(chi-square(df) >= statistic); at temperature 0, 1 or 0.
        adjusted_p: Holm-adjusted p-value across the prompts.
        passed: ``adjusted_p >= alpha`` (temperature 0: the tokens were identical).
        prefixes_tested: Prefixes with a conditional test of their own.
        drafted, accepted: Draft tokens proposed and kept over all samples (a check in which
            nothing was drafted tests nothing).
        mismatch_at: Temperature 0: first position where speculation and plain decoding differ.
    """

    prompt: str
    samples: int = 0
    statistic: float = 0.0
    df: int = 0
    p_value: float = 1.0
    adjusted_p: float = 1.0
    passed: bool = True
    prefixes_tested: int = 0
    drafted: int = 0
    accepted: int = 0
    mismatch_at: int | None = None


@dataclass
class VerifyReport:
    """Every prompt's verdict and the settings (``to_dict`` is the ``--json`` record).

    Attributes:
        checks: One ``PromptCheck`` per prompt.
        alpha: Family-wise significance level.
        self_test: Whether the acceptance rule was broken on purpose.
    """

    checks: list[PromptCheck] = field(default_factory=list)
    alpha: float = DEFAULT_ALPHA
    self_test: bool = False

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "alpha": self.alpha, "self_test": self.self_test,
                "prompts": [asdict(check) for check in self.checks]}


# --- statistics ------------------------------------------------------------------------------


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularised upper gamma Q(df / 2, statistic / 2).

    Series for x < a + 1, Lentz's continued fraction otherwise (Numerical Recipes, section 6.2).
    """
    if df <= 0 or statistic <= 0:
        return 1.0
    if math.isinf(statistic):
        return 0.0
    a, x = df / 2.0, statistic / 2.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        for n in range(1, 10_000):
            term *= x / (a + n)
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for n in range(1, 10_000):
        an, b = -n * (n - a), b + 2
        d = 1.0 / (an * d + b if abs(an * d + b) > 1e-300 else 1e-300)
        c = b + an / c if abs(b + an / c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return min(1.0, h * math.exp(log_front))


def g_statistic(observed: Counter, probs: np.ndarray) -> tuple[float, int]:
    """G = 2 Σ O ln(O / E) of next-token counts against the exact probabilities, rare cells pooled.

    Cells expected below ``MIN_EXPECTED`` samples are pooled into one; a pool still below it joins
    the smallest other cell. A token with probability 0 makes G infinite.

    Args:
        observed: Counts per token id.
        probs (np.ndarray): The target's next-token probabilities, shape [V], float64.

    Returns:
        tuple[float, int]: G and its degrees of freedom (cells - 1).
    """
    n = sum(observed.values())
    if any(probs[token] <= 0 for token in observed):
        return math.inf, 1
    expected = probs * n
    big = np.flatnonzero(expected >= MIN_EXPECTED)
    cells = [[observed.get(int(t), 0), expected[t]] for t in big]
    pooled = [n - sum(o for o, _ in cells), n - sum(e for _, e in cells)]
    if pooled[1] > 1e-9:
        if pooled[1] < MIN_EXPECTED and cells:
            smallest = min(cells, key=lambda cell: cell[1])
            smallest[0], smallest[1] = smallest[0] + pooled[0], smallest[1] + pooled[1]
        else:
            cells.append(pooled)
    g = 2.0 * sum(o * math.log(o / e) for o, e in cells if o > 0)
    return max(g, 0.0), len(cells) - 1


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control; Holm 1979)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


# --- the target's exact conditionals ----------------------------------------------------------


def exact_conditionals(
    model,
    prompt: list[int],
    prefixes: Iterable[tuple[int, ...]],
    sampling: SamplingParams,
    batch_size: int = 32,
) -> dict[tuple[int, ...], np.ndarray]:
    """The target's warped next-token probabilities after ``prompt + prefix`` for each prefix.

    Prefixes of one length share a batched forward ([B, L + k] tokens, no cache); logits processors
    (repetition penalty) see each row's own prefix.

    Returns:
        dict: prefix → probabilities, shape [V], float64.
    """
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for prefix in prefixes:
        by_length.setdefault(len(prefix), []).append(prefix)
    out, processors = {}, sampling.processors()
    for rows in by_length.values():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            tokens = mx.array([prompt + list(prefix) for prefix in chunk], dtype=mx.int32)  # [B, L + k]
            logits = model(tokens)[:, -1].astype(mx.float32)  # [B, V]
            if processors:
                logits = mx.concatenate([process_logits(logits[i : i + 1], tokens[i], processors)
                                         for i in range(len(chunk))])
            probs = np.array(mx.exp(warp(logits, sampling)), dtype=np.float64)
            out.update({prefix: row / row.sum() for prefix, row in zip(chunk, probs)})
    return out


def g_test_samples(
    model, prompt: list[int], samples: Counter, sampling: SamplingParams
) -> tuple[float, int, int]:
    """Sum of per-prefix G statistics of K-token samples against the target's exact conditionals.

    Every prefix of length k < K reached by at least ``MIN_PREFIX_SAMPLES`` samples is tested on
    the tokens that followed it.

    Returns:
        tuple[float, int, int]: G, degrees of freedom, prefixes tested.
    """
    following: dict[tuple[int, ...], Counter] = {}
    for sequence, count in samples.items():
        for k in range(len(sequence)):
            following.setdefault(sequence[:k], Counter())[sequence[k]] += count
    tested = [p for p, c in following.items() if sum(c.values()) >= MIN_PREFIX_SAMPLES]
    exact = exact_conditionals(model, prompt, tested, sampling)
    g, df = 0.0, 0
    for prefix in tested:
        g_prefix, df_prefix = g_statistic(following[prefix], exact[prefix])
        g, df = g + g_prefix, df + df_prefix
    return g, df, len(tested)


# --- sampling through speculation ---------------------------------------------------------------


def broken_rule(sampling: SamplingParams) -> Callable:
    """A deliberately WRONG acceptance rule for ``--self-test``.

    At temperature > 0: the exact rule's accept/reject choices, but after a rejection the token
    is drawn from p instead of the residual (the classic mistake, which over-weights drafted
    tokens). At temperature 0: every first child is accepted whatever the target says.
    """
    exact = make_verifier(sampling)

    def broken(tokens, tree, logits, draft):
        choice, next_tokens = exact(tokens, tree, logits, draft)
        if sampling.greedy:
            first = np.maximum(tree.children[:, 0], 0)
            return mx.array(first, dtype=mx.int32), next_tokens
        return choice, mx.random.categorical(warp(logits, sampling), axis=-1).astype(mx.int32)

    return broken


def batchable(drafter: Drafter) -> bool:
    """Whether samples at one prefix may share the drafter's proposal: host-side, deterministic in
    the committed tokens, with no per-sequence state (``prefill``/``commit`` are the base no-ops)."""
    kind = type(drafter)
    return (not drafter.lazy and not drafter.needs_hidden and kind.prefill is Drafter.prefill
            and kind.commit is Drafter.commit)


@dataclass
class Sampled:
    """K-token samples and how much was drafted for them."""

    counts: Counter = field(default_factory=Counter)
    drafted: int = 0
    accepted: int = 0


def _engine_rounds(model, prompt: list[int], drafter: Drafter, sampling: SamplingParams, *, num_tokens: int,
                   policy: Pacer, rule: Callable) -> tuple[list[int], int, int]:
    """One run of the engine's round loop (no stop tokens), the policy told each round as ``generate`` tells
    it.

    Returns:
        tuple: the tokens, draft tokens proposed, draft tokens kept.
    """
    tokens, drafted, accepted = [], 0, 0
    for round_ in speculative_rounds(model, prompt, drafter, num_draft_tokens=policy, max_tokens=num_tokens,
                                     sampling=sampling, stop_tokens=set(), rule=rule):
        tokens += round_.tokens
        drafted, accepted = drafted + round_.stats.num_drafted, accepted + round_.stats.num_accepted
    return tokens, drafted, accepted


def sample_engine(model, prompt: list[int], drafter: Drafter, sampling: SamplingParams, *, num_tokens: int,
                  num_samples: int, num_draft_tokens: int | Pacer, rule: Callable,
                  progress: Callable[[int], None]) -> Sampled:
    """``num_samples`` runs of the engine's round loop, ``num_tokens`` tokens each (no stop tokens).

    A γ policy (``pacing.make_pacer``: ``auto``, ``scheduled``) is shared by the runs and learns across them,
    as in a chat; each run is still distributed as the target, whatever the policy learnt before it (its
    choices depend on earlier tokens only), so the runs stay independent draws from the target."""
    policy = Fixed(num_draft_tokens) if isinstance(num_draft_tokens, int) else num_draft_tokens
    out = Sampled()
    for _ in range(num_samples):
        tokens, drafted, accepted = _engine_rounds(model, prompt, drafter, sampling, num_tokens=num_tokens,
                                                   policy=policy, rule=rule)
        out.drafted, out.accepted = out.drafted + drafted, out.accepted + accepted
        out.counts[tuple(tokens)] += 1
        progress(1)
    return out


def _copy_cache(cache: list) -> list:
    copies = []
    for layer in cache:
        copy = KVCache()
        copy.state = layer.state  # the copy's first write concatenates into new arrays
        copies.append(copy)
    return copies


def _state_logits(model, cache: list, last_prompt_token: int, state: list[int], draft: Draft) -> mx.array:
    """Target logits at the root (``state[-1]``, else the prompt's last token) and each draft node,
    [N + 1, V], from one forward: the sampled tokens as a chain with the draft tree hanging below."""
    s, offset = len(state), len(state) - 1
    parents = tuple(range(-1, s - 1)) + tuple(p + s if p >= 0 else offset for p in draft.tree.parents)
    tokens = mx.concatenate([mx.array([last_prompt_token, *state], dtype=mx.int32), draft.tokens])
    with tree_attention(model, cache, Tree(parents)):
        return model(tokens[None], cache=cache)[0, s:]


def _round_tokens(draft: Draft, choice: list[int], next_tokens: list[int]) -> tuple[list[int], int]:
    path = draft.tree.walk(choice)
    drafted = draft.tokens.tolist() if draft.size else []
    return [drafted[node - 1] for node in path] + [next_tokens[path[-1] if path else 0]], len(path)


def sample_batched(
    model,
    prompt: list[int],
    drafter: Drafter,
    sampling: SamplingParams,
    *,
    num_tokens: int,
    num_samples: int,
    num_draft_tokens: int,
    rule: Callable,
    progress: Callable[[int], None],
) -> Sampled:
    """The same samples as ``sample_engine`` for a ``batchable`` drafter, sharing work between samples.

    All samples at one prefix get the drafter's one proposal and one target forward over
    ``[prompt[-1], *prefix, *draft]`` from a copy of the prompt's cache (the prefix as a chain with the
    draft tree below it: tree mask and positions as in the engine); each sample then makes its own
    acceptance draws with ``rule``.
    """
    base = make_prompt_cache(model)
    prefill(model, base, prompt[:-1])
    out, pending = Sampled(), Counter({(): num_samples})
    while pending:
        state, n = pending.popitem()
        if len(state) >= num_tokens:
            out.counts[state] += n
            progress(n)
            continue
        history, room = prompt + list(state), num_tokens - len(state)
        draft = drafter.propose(history, min(num_draft_tokens, room - 1), sampling)
        logits = _state_logits(model, _copy_cache(base), prompt[-1], list(state), draft)  # [N + 1, V]
        tokens = mx.concatenate([mx.array(history[-1:], dtype=mx.int32), draft.tokens])  # [N + 1]
        processors = sampling.processors()
        if processors:
            paths = [draft.tree.path_to(node) for node in range(draft.size + 1)]
            logits = process_logits(
                logits, mx.array(history, dtype=mx.int32), processors, draft.tokens, paths
            )
        mx.eval(logits, tokens)
        for start in range(0, n, DRAWS_PER_EVAL):
            draws = [rule(tokens, draft.tree, logits, draft) for _ in range(min(DRAWS_PER_EVAL, n - start))]
            mx.eval(draws)
            for choice, next_tokens in draws:
                emitted, kept = _round_tokens(draft, choice.tolist(), next_tokens.tolist())
                pending[state + tuple(emitted[:room])] += 1
                out.drafted, out.accepted = out.drafted + draft.size, out.accepted + min(kept, room)
    return out


def greedy_mismatch(model, prompt: list[int], drafter: Drafter, *, num_tokens: int,
                    num_draft_tokens: int | Pacer, rule: Callable) -> tuple[int | None, int, int]:
    """First position where greedy speculation differs from mlx-lm's plain greedy decoding (or ``None``).

    Returns:
        tuple: the position, draft tokens proposed, draft tokens kept.
    """
    plain = [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=num_tokens)]
    policy = Fixed(num_draft_tokens) if isinstance(num_draft_tokens, int) else num_draft_tokens
    spec, drafted, accepted = _engine_rounds(model, prompt, drafter, SamplingParams(), num_tokens=num_tokens,
                                             policy=policy, rule=rule)
    mismatch = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), None)
    if mismatch is None and len(spec) != len(plain):
        mismatch = min(len(spec), len(plain))
    return mismatch, drafted, accepted


def check_prompt(model, prompt_text: str, prompt: list[int], drafter: Drafter, sampling: SamplingParams, *,
                 num_tokens: int, num_samples: int, num_draft_tokens: int | Pacer, rule: Callable,
                 progress: Callable[[int], None], batch: bool = True) -> PromptCheck:
    """Sample one prompt through speculation and test it (temperature 0: compare with plain greedy).

    Returns:
        PromptCheck: with ``p_value`` set; ``adjusted_p``/``passed`` are set by ``run_check``.
    """
    if sampling.greedy:
        mismatch, drafted, accepted = greedy_mismatch(model, prompt, drafter, num_tokens=num_tokens,
                                                      num_draft_tokens=num_draft_tokens, rule=rule)
        progress(1)
        return PromptCheck(prompt_text, p_value=0.0 if mismatch is not None else 1.0, drafted=drafted,
                           accepted=accepted, mismatch_at=mismatch)
    fixed = isinstance(num_draft_tokens, int)  # a γ policy chooses per round: the engine's own loop
    sample = sample_batched if batch and fixed and batchable(drafter) else sample_engine
    sampled = sample(model, prompt, drafter, sampling, num_tokens=num_tokens, num_samples=num_samples,
                     num_draft_tokens=num_draft_tokens, rule=rule, progress=progress)
    g, df, tested = g_test_samples(model, prompt, sampled.counts, sampling)
    return PromptCheck(prompt_text, num_samples, g, df, chi2_sf(g, df), prefixes_tested=tested,
                       drafted=sampled.drafted, accepted=sampled.accepted)


def check_num_tokens(num_tokens: int) -> None:
    """Refuse a sampled length past ``MAX_TOKENS`` (see there: no power gained, hours or days spent).

    Raises:
        ValueError: naming ``--tokens``, the bound and why.
    """
    if num_tokens > MAX_TOKENS:
        raise ValueError(
            f"--tokens must be at most {MAX_TOKENS}, got {num_tokens}: a token is tested only where "
            f"{MIN_PREFIX_SAMPLES} or more samples share its prefix, which long prefixes almost never "
            "are, while the time grows with --samples × --tokens; the default 3 is usually enough"
        )


def run_check(
    model,
    prompts: list[tuple[str, list[int]]],
    drafter: Drafter,
    sampling: SamplingParams,
    *,
    num_tokens: int = DEFAULT_TOKENS,
    num_samples: int = DEFAULT_SAMPLES,
    num_draft_tokens: int | Pacer = 4,
    alpha: float = DEFAULT_ALPHA,
    self_test: bool = False,
    typical: tuple[float, float] | None = None,
    seed: int | None = 0,
    batch: bool = True,
    progress: Callable[[int], None] = lambda n: None,
) -> VerifyReport:
    """Check that speculation with ``drafter`` samples exactly as ``model`` on each prompt.

    Args:
        model: The target, an mlx-lm model.
        prompts: ``(text, token ids)`` per prompt.
        drafter: The drafter under test.
        sampling: The sampling settings under test; temperature 0 compares with plain greedy decoding.
        num_tokens: K, tokens sampled per sequence (at temperature 0: tokens compared). Default: ``3``.
        num_samples: N, sequences per prompt. Default: ``2000``.
        num_draft_tokens: γ, or a γ policy (``pacing.make_pacer("auto", ...)``: what ``generate`` runs),
            shared by every sample and prompt and updated after each round as ``generate`` does. Default:
            ``4``.
        alpha: Family-wise level; a prompt FAILs when its Holm-adjusted p-value is below it. Default:
            ``0.01``.
        self_test: Use ``broken_rule`` instead of the exact rule (the check should then FAIL).
        typical: ``(threshold, alpha)``: check Medusa's LOSSY typical acceptance instead (it should FAIL).
        seed: Seed for ``mx.random``, or ``None``. Default: ``0``.
        batch: Share work between samples when the drafter allows (``batchable``). Default: ``True``.
        progress: Called with the number of samples (or greedy prompts) just finished.

    Returns:
        VerifyReport: one verdict per prompt.

    Raises:
        ValueError: no prompts, ``num_tokens`` or ``num_samples`` < 1, ``num_tokens`` > ``MAX_TOKENS`` at
            temperature > 0, ``num_draft_tokens`` < 0, or ``alpha`` outside (0, 1).
    """
    if not prompts:
        raise ValueError("no prompts to check; give --prompts FILE with one prompt per line")
    for value, flag in [(num_tokens, "--tokens"), (num_samples, "--samples")]:
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not sampling.greedy:
        check_num_tokens(num_tokens)
    if isinstance(num_draft_tokens, int) and num_draft_tokens < 0:
        raise ValueError(f"--num-draft-tokens must be >= 0, got {num_draft_tokens}")
    if not 0 < alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), got {alpha}")
    if seed is not None:
        mx.random.seed(seed)
    rule = broken_rule(sampling) if self_test else make_verifier(sampling, typical)
    checks = [
        check_prompt(
            model,
            text,
            ids,
            drafter,
            sampling,
            num_tokens=num_tokens,
            num_samples=num_samples,
            num_draft_tokens=num_draft_tokens,
            rule=rule,
            progress=progress,
            batch=batch,
        )
        for text, ids in prompts
    ]
    for check, adjusted in zip(checks, holm([c.p_value for c in checks])):
        check.adjusted_p = adjusted
        check.passed = check.mismatch_at is None if sampling.greedy else adjusted >= alpha
    return VerifyReport(checks, alpha, self_test)
