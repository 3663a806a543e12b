"""The acceptance rules' output distributions, computed exactly on small vocabularies (no sampling).

A rule draws its randomness from ``mx.random.uniform`` (one u per node, or one per node and sibling
slot) and ``mx.random.categorical`` (the resampled or bonus token at every node). Here ``uniform``
returns chosen values and ``categorical`` records the distribution it is handed. A rule's decision at a
node is monotone in that node's u (accept while u is below a threshold), so bisection on u gives the
probability of each of the node's outcomes to float32 precision, and the recorded rows give the
token emitted when the walk stops there. That yields, for a fixed draft, the exact distribution of the
token emitted after every node; averaged over how the drafter draws that node's children it must be p
at that node (Leviathan et al. 2023, arXiv 2211.17192, Theorem 1; SpecInfer, arXiv 2305.09781, 4.2).

The statistical versions of these checks (chi-square on thousands of rounds, and through the engine)
are in test_verify.py, test_tree.py and test_lossless.py under the ``slow`` marker.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.core.tree import Tree, chain
from mlxspec.core.verify import verify_deterministic, verify_sampled

V = 4
ONE = float(np.nextafter(np.float32(1), np.float32(0)))  # the largest u below 1: rejects unless p >= q
RNG = np.random.default_rng(7)
P = RNG.dirichlet(np.full(V, 0.8), size=3).astype(np.float32)  # p at nodes 0, 1, 2 (root first)
Q = RNG.dirichlet(np.full(V, 0.8), size=3).astype(np.float32)  # q that drafts each node's children
TREE = Tree((-1, -1, 0, 0))  # root with children a, b; a with children a1, a2


class Draws:
    """Stands in for ``mx.random``: ``uniform`` hands out the rows of ``u`` call by call,
    ``categorical`` records its input as probabilities [N + 1, V] and returns token 0."""

    def __init__(self, u: list[np.ndarray]):
        self.u, self.calls, self.rows = u, 0, None

    def uniform(self, shape=(), **_):
        row = self.u[min(self.calls, len(self.u) - 1)]
        self.calls += 1
        return mx.array(row.astype(np.float32)).reshape(shape)

    def categorical(self, logits, axis=-1, **_):
        self.rows = np.array(mx.softmax(logits, axis=axis))
        return mx.zeros(logits.shape[:-1], dtype=mx.int32)


def _run(rule, u: list[np.ndarray], monkeypatch) -> tuple[np.ndarray, np.ndarray, int]:
    draws = Draws(u)
    monkeypatch.setattr(mx.random, "uniform", draws.uniform)
    monkeypatch.setattr(mx.random, "categorical", draws.categorical)
    choice, next_tokens = rule()
    mx.eval(choice, next_tokens)
    monkeypatch.undo()
    return np.array(choice), draws.rows, draws.calls


def _threshold(rule, n_nodes: int, fixed: list[np.ndarray], slot: int, accepted, monkeypatch) -> np.ndarray:
    """Per node, sup{u in slot ``slot``: accepted(choice)[n]} by bisection (slots before
    it held at ``fixed``)."""
    lo, hi = np.zeros(n_nodes), np.ones(n_nodes)
    for _ in range(30):
        mid = (lo + hi) / 2
        u = list(fixed)
        u[slot] = mid
        ok = accepted(_run(rule, u, monkeypatch)[0])
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
    ok = accepted(_run(rule, [*fixed[:slot], np.zeros(n_nodes), *fixed[slot + 1:]], monkeypatch)[0])
    return np.where(ok, lo, 0.0)  # a child never accepted, even at u = 0, has measure 0


def emitted_after(rule, tokens: list[int], tree: Tree, monkeypatch) -> np.ndarray:
    """Exact distribution of the token emitted after each node, for one fixed draft; [N + 1, V].

    With one uniform draw per node (the deterministic rule, or any rule on a chain), the node's
    children are accepted on consecutive intervals of u; with one draw per sibling slot (the sampled
    rule), slot j is reached when slots before it rejected, and accepts below its own threshold.
    """
    n_nodes, children = tree.size + 1, tree.children
    n_slots = _run(rule, [np.zeros(n_nodes)], monkeypatch)[2]
    ones = [np.full(n_nodes, ONE)] * n_slots
    _, stop_rows, _ = _run(rule, ones, monkeypatch)  # every sibling rejected: the resampled / bonus rows
    prob = np.zeros((n_nodes, children.shape[1]))  # P(choice = the node's j-th child)
    reach = np.ones(n_nodes)
    below = np.zeros(n_nodes)
    for j in range(children.shape[1]):
        if n_slots == 1:  # one u per node: child j owns [t_{j-1}, t_j)
            cum = _threshold(rule, n_nodes, ones, 0,
                             lambda c, j=j: np.isin(c, children[:, : j + 1]) & (c > 0), monkeypatch)
            prob[:, j], below = np.maximum(cum - below, 0.0), np.maximum(cum, below)
        else:  # slot j: reached with probability reach, accepted below its threshold
            t = _threshold(rule, n_nodes, ones, j, lambda c, j=j: (c == children[:, j]) & (c > 0),
                           monkeypatch)
            prob[:, j], reach = reach * t, reach * (1 - t)
    out = np.zeros((n_nodes, V))
    for n in range(n_nodes):
        for j, child in enumerate(children[n]):
            if child > 0:
                out[n, tokens[child]] += prob[n, j]
        out[n] += (1 - prob[n].sum()) * stop_rows[n]
    return out


def _log(rows) -> mx.array:
    return mx.log(mx.array(np.asarray(rows, dtype=np.float32)))


def _sampled(tokens, q_rows, p_rows, tree):
    return lambda: verify_sampled(mx.array(tokens, dtype=mx.int32), tree, _log(q_rows), _log(p_rows))


def _deterministic(tokens, p_rows, tree):
    return lambda: verify_deterministic(mx.array(tokens, dtype=mx.int32), tree, _log(p_rows))


def _chain_sampled_marginals(make_rule, monkeypatch) -> np.ndarray:
    """Token emitted after nodes 0 and 1 of a chain of 2, each averaged over its draft d ~ q."""
    out = np.zeros((2, V))
    for node, d in itertools.product(range(2), range(V)):
        drafts = [1, 2]
        drafts[node] = d
        out[node] += Q[node, d] * emitted_after(make_rule([0, *drafts]), [0, *drafts],
                                                chain(2), monkeypatch)[node]
    return out


def test_a_sampled_chain_emits_p_after_every_node(monkeypatch):
    got = _chain_sampled_marginals(lambda tokens: _sampled(tokens, Q[:2], P, chain(2)), monkeypatch)
    np.testing.assert_allclose(got, P[:2], atol=2e-6)


@pytest.mark.parametrize("drafts", list(itertools.product(range(V), repeat=2)))
def test_any_fixed_chain_emits_p_after_every_node(drafts, monkeypatch):
    """A deterministic drafter (n-gram, greedy): whatever it proposes, each position follows p."""
    tokens = [0, *drafts]
    got = emitted_after(_deterministic(tokens, P, chain(2)), tokens, chain(2), monkeypatch)
    np.testing.assert_allclose(got, P, atol=2e-6)


def test_top_k_children_emit_p_after_every_node(monkeypatch):
    """EAGLE-2/Medusa-style deterministic trees: siblings tried in order, each
    removed from r once rejected."""
    a, b = np.argsort(-P[0])[:2].tolist()
    a1, a2 = np.argsort(-P[1])[:2].tolist()
    tokens = [0, a, b, a1, a2]
    p_rows = [P[0], P[1], P[2], P[2], P[2]]
    got = emitted_after(_deterministic(tokens, p_rows, TREE), tokens, TREE, monkeypatch)
    np.testing.assert_allclose(got, p_rows, atol=2e-6)


def _without_replacement(q: np.ndarray, pair: tuple[int, int], raw: bool = False):
    """Probability of drawing ``pair`` in order without replacement, and the q each token was drawn from."""
    first = q / q.sum()
    second = first.copy()
    second[pair[0]] = 0
    second /= second.sum()
    rows = [q, q] if raw else [first, second]  # raw: the mistake of not renormalising after sibling 1
    return first[pair[0]] * second[pair[1]], rows


def _tree_sampled_marginals(monkeypatch, raw: bool = False) -> np.ndarray:
    """Token emitted after the root and after a, each averaged over its two children
    drawn without replacement."""
    out = np.zeros((2, V))
    for node, pair in itertools.product(range(2), itertools.permutations(range(V), 2)):
        kids = {0: (0, 1), 1: (2, 3)}
        kids[node] = pair
        weight, rows = _without_replacement(Q[node], pair, raw)
        q_rows = [*(rows if node == 0 else _without_replacement(Q[0], kids[0])[1]),
                  *(rows if node == 1 else _without_replacement(Q[1], kids[1])[1])]
        tokens = [0, *kids[0], *kids[1]]
        p_rows = [P[0], P[1], P[2], P[2], P[2]]
        rule = _sampled(tokens, q_rows, p_rows, TREE)
        out[node] += weight * emitted_after(rule, tokens, TREE, monkeypatch)[node]
    return out


def test_sampled_siblings_without_replacement_emit_p(monkeypatch):
    np.testing.assert_allclose(_tree_sampled_marginals(monkeypatch), P[:2], atol=2e-6)


# The same computation tells wrong rules apart: each of these is a classic mistake.

def test_resampling_from_p_instead_of_the_residual_is_not_p(monkeypatch):
    def without_residual(tokens):
        rule = _sampled(tokens, Q[:2], P, chain(2))

        def run():
            choice, _ = rule()
            return choice, mx.random.categorical(_log(P), axis=-1).astype(mx.int32)
        return run

    got = _chain_sampled_marginals(without_residual, monkeypatch)
    assert np.abs(got - P[:2]).sum(axis=1).max() > 0.05


def test_greedy_drafts_scored_as_sampled_are_not_p(monkeypatch):
    """Drafting argmax q but handing the rule the softmax q, as if the token had been drawn from it."""
    out = np.zeros((2, V))
    drafts = [int(Q[0].argmax()), int(Q[1].argmax())]
    rule = _sampled([0, *drafts], Q[:2], P, chain(2))
    out = emitted_after(rule, [0, *drafts], chain(2), monkeypatch)[:2]
    assert np.abs(out - P[:2]).sum(axis=1).max() > 0.05


def test_siblings_scored_with_q_not_renormalised_are_not_p(monkeypatch):
    got = _tree_sampled_marginals(monkeypatch, raw=True)
    assert np.abs(got - P[:2]).sum(axis=1).max() > 0.05
