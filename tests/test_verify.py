"""The acceptance rules on hand-made distributions: chains here, branching trees in test_tree_verify.py."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.core.tree import chain
from mlxspec.core.verify import verify_deterministic, verify_greedy, verify_sampled
from stats import chi_square

V, K = 6, 2


def _dists(seed: int, rows: int) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.full(V, 0.7), size=rows).astype(np.float32)


P = _dists(0, K + 1)  # target rows 0..K (K = bonus)
Q = _dists(1, K)
CHAIN = chain(K)


def verify_chain(drafts: mx.array, q_log: mx.array | None, p_log: mx.array, tree=CHAIN):
    """(accepted count, emitted next token) through the tree rules on a chain."""
    tokens = mx.concatenate([mx.array([0], dtype=mx.int32), drafts])
    if q_log is None:
        choice, next_tokens = verify_deterministic(tokens, tree, p_log)
    else:
        choice, next_tokens = verify_sampled(tokens, tree, q_log, p_log)
    path = tree.walk(choice.tolist())
    return len(path), next_tokens.tolist()[path[-1] if path else 0]


def _run(verifier, n_trials: int, q_rows: np.ndarray | None, draft_from: np.ndarray, seed: int = 0):
    """Counts of the emitted token at each depth, conditioned on reaching that depth."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    p_log = mx.log(mx.array(P))
    q_log = None if q_rows is None else mx.log(mx.array(q_rows))
    counts = [Counter() for _ in range(K + 1)]
    for _ in range(n_trials):
        drafts = np.array([rng.choice(V, p=row) for row in draft_from], dtype=np.int32)
        n, token = verifier(mx.array(drafts), q_log, p_log)
        emitted = list(drafts[:n]) + [token]
        for depth, token in enumerate(emitted):
            counts[depth][int(token)] += 1
    return counts


def _all_depths_match_p(counts) -> bool:
    for depth, observed in enumerate(counts):
        stat, critical = chi_square(observed, dict(enumerate(P[depth].tolist())))
        if stat > critical:
            return False
    return True


def test_identical_p_and_q_accept_everything():
    p_log = mx.log(mx.array(P))
    for seed in range(20):
        mx.random.seed(seed)
        drafts = mx.random.categorical(p_log[:K]).astype(mx.int32)
        n, _ = verify_chain(drafts, p_log[:K], p_log)
        assert n == K


def test_disjoint_supports_reject_at_zero_and_sample_from_p():
    p = np.array([[0, 0, 0.5, 0.5, 0, 0]] * (K + 1), dtype=np.float32)
    q = np.array([[0.5, 0.5, 0, 0, 0, 0]] * K, dtype=np.float32)
    seen = set()
    for seed in range(30):
        mx.random.seed(seed)
        n, token = verify_chain(mx.array([0, 1], dtype=mx.int32), mx.log(mx.array(q)), mx.log(mx.array(p)))
        assert n == 0
        seen.add(token)
    assert seen == {2, 3}


@pytest.mark.slow  # statistical
def test_one_hot_draft_is_accepted_with_probability_p():
    p_log = mx.log(mx.array(P))
    drafts = mx.array([3, 3], dtype=mx.int32)
    mx.random.seed(0)
    accepted_first = sum(verify_chain(drafts, None, p_log)[0] >= 1 for _ in range(3000))
    rate = accepted_first / 3000
    assert abs(rate - P[0, 3]) < 4 * np.sqrt(P[0, 3] * (1 - P[0, 3]) / 3000)


@pytest.mark.slow  # statistical
def test_one_hot_rejection_resamples_from_p_without_the_draft():
    p_log = mx.log(mx.array(P))
    drafts = mx.array([1, 4], dtype=mx.int32)
    mx.random.seed(0)
    counts = Counter()
    while sum(counts.values()) < 3000:
        n, token = verify_chain(drafts, None, p_log)
        if n == 0:
            counts[token] += 1
    assert 1 not in counts
    expected = P[0].copy()
    expected[1] = 0
    stat, critical = chi_square(counts, dict(enumerate((expected / expected.sum()).tolist())))
    assert stat < critical


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "one-hot-q"])
def test_emitted_tokens_follow_p(deterministic):
    if deterministic:  # a deterministic drafter: fixed tokens, q one-hot
        counts = _run(verify_chain, 4000, None, np.eye(V, dtype=np.float32)[[2, 5]])
    else:
        counts = _run(verify_chain, 4000, Q, Q)
    assert _all_depths_match_p(counts)


def _verify_without_residual(draft_tokens, draft_logprobs, target_logprobs):
    """The classic mistake: on rejection, resample from p instead of the residual."""
    n, _ = verify_chain(draft_tokens, draft_logprobs, target_logprobs)
    return n, mx.random.categorical(target_logprobs[n]).item()


@pytest.mark.slow  # statistical
def test_a_verifier_without_residual_fails_the_same_test():
    assert not _all_depths_match_p(_run(_verify_without_residual, 4000, Q, Q))


@pytest.mark.slow  # statistical
def test_greedy_drafts_scored_as_sampled_fail_the_same_test():
    """Drafting argmax q but passing the softmax q as if the token were sampled from it."""
    greedy_rows = np.eye(V, dtype=np.float32)[Q.argmax(axis=1)]
    assert not _all_depths_match_p(_run(verify_chain, 4000, Q, greedy_rows))


def test_greedy_keeps_longest_matching_prefix():
    logits = mx.array(np.eye(V, dtype=np.float32)[[1, 2, 3, 4]])  # argmax 1, 2, 3, 4
    tree = chain(3)
    for drafts, expected in [([1, 2, 3], [1, 2, 3]), ([1, 2, 0], [1, 2]), ([0, 2, 3], [])]:
        choice, next_tokens = verify_greedy(mx.array([9] + drafts, dtype=mx.int32), tree, logits)
        assert tree.walk(choice.tolist()) == expected
        assert next_tokens.tolist() == [1, 2, 3, 4]


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\[N \+ 1, V\]"):
        verify_deterministic(mx.array([0, 1, 2], dtype=mx.int32), chain(2), mx.zeros((2, V)))
