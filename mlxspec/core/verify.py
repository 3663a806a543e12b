"""Acceptance rules for a drafted tree: pure array functions, no host sync.

Every rule returns lazy arrays ``(choice, next_tokens)`` over the root-first nodes
(index 0 is the root, draft node i is i + 1; see ``mlxspec.core.tree``):

- ``choice[n]``: the child of node n that the target accepts (root-first index), 0 for none;
- ``next_tokens[n]``: the token emitted if the walk stops at node n — resampled from
  the residual when n's children were all rejected, the bonus token from p when n is a leaf.

Each node's random draws are made up front, so the caller evaluates both arrays in
its one blocking sync per round, then walks ``choice`` from the root on the host
(``Tree.walk``): a rejection never costs a second round trip. A chain is the tree in
which every node has one child, and runs through the same code.

Letters: p is the target's (warped) distribution, q the drafter's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .tree import Tree, sibling_tokens


def _check_shapes(tree: Tree, tokens: mx.array, target: mx.array, draft_logprobs: mx.array | None = None):
    N = tree.size
    if tokens.shape != (N + 1,):
        raise ValueError(f"tokens must have shape [N + 1] = [{N + 1}] (root first), got {tokens.shape}")
    if target.ndim != 2 or target.shape[0] != N + 1:
        raise ValueError(f"target scores must have shape [N + 1, V] = [{N + 1}, V], got {target.shape}")
    if draft_logprobs is not None and draft_logprobs.shape != (N, target.shape[1]):
        raise ValueError(
            f"draft log-probs must have shape [N, V] = [{N}, {target.shape[1]}], got {draft_logprobs.shape}"
        )


def _first_true(mask: mx.array, children: np.ndarray) -> mx.array:
    """Root-first index of the child in the first True slot of each row, 0 when none; [N + 1] int32."""
    slot = mx.argmax(mask, axis=1)
    child = mx.take_along_axis(mx.array(children), slot[:, None], axis=1)[:, 0]
    return mx.where(mask.any(axis=1), child, 0).astype(mx.int32)


def verify_greedy(tokens: mx.array, tree: Tree, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verification: follow the children that equal the target's argmax.

    Leviathan et al. 2023 (arXiv 2211.17192), section 2.3 in the ``temp -> 0`` limit;
    for trees, Medusa (arXiv 2401.10774) section 2.3: the longest accepted path.
    The output is token for token plain greedy decoding.

    Args:
        tokens (mx.array): Root-first node tokens, shape [N + 1], int32 (may be lazy).
        tree: The draft's structure.
        target_logits (mx.array): Processed target scores, shape [N + 1, V]; row n scores the
            position after node n.

    Returns:
        tuple[mx.array, mx.array]: ``choice`` and ``next_tokens`` (the argmax at every
        node), both [N + 1] int32 and lazy.

    Raises:
        ValueError: if the shapes disagree.
    """
    _check_shapes(tree, tokens, target_logits)
    argmax = mx.argmax(target_logits, axis=-1).astype(mx.int32)
    sib, valid = sibling_tokens(tokens, tree.children)
    return _first_true(valid & (sib == argmax[:, None]), tree.children), argmax


def _without(logprobs: mx.array, sib: mx.array, valid: mx.array) -> mx.array:
    """log p with each row's valid sibling tokens removed, renormalised; rows left empty fall back to p."""
    V = logprobs.shape[-1]
    out = logprobs
    for j in range(sib.shape[1]):
        out = mx.where(valid[:, j : j + 1] & (mx.arange(V)[None, :] == sib[:, j : j + 1]), -mx.inf, out)
    total = mx.logsumexp(out, axis=-1, keepdims=True)
    return mx.where(mx.isinf(total), logprobs, out - total)


def verify_deterministic(
    tokens: mx.array, tree: Tree, target_logprobs: mx.array
) -> tuple[mx.array, mx.array]:
    """Exact verification of deterministic drafts (q one-hot): n-gram, greedy or top-k children.

    docs/acceptance.md 2.4 (EAGLE-2 arXiv 2406.16858; SpecInfer arXiv 2305.09781, section 4.2 with
    one-hot q): at a node, sibling x_j is tried in order and accepted with probability
    r(x_j), where r is p with the earlier rejected siblings removed and renormalised; if
    all are rejected the next token comes from that r; a leaf emits a bonus token from p.
    Implemented in the equivalent single-uniform form: one u per node accepts the first
    sibling with u < Σ_{i<=j} p(x_i). Repeated sibling tokens are skipped.

    Args:
        tokens (mx.array): Root-first node tokens, shape [N + 1], int32 (may be lazy).
        tree: The draft's structure.
        target_logprobs (mx.array): Warped log p, shape [N + 1, V], float32.

    Returns:
        tuple[mx.array, mx.array]: ``choice`` and ``next_tokens``, both [N + 1] int32, lazy.

    Raises:
        ValueError: if the shapes disagree.
    """
    _check_shapes(tree, tokens, target_logprobs)
    sib, valid = sibling_tokens(tokens, tree.children)
    sib_probs = mx.where(valid, mx.exp(mx.take_along_axis(target_logprobs, sib, axis=1)), 0.0)
    u = mx.random.uniform(shape=(tree.size + 1, 1))
    cumulative = mx.cumsum(sib_probs, axis=1)
    choice = _first_true(u < cumulative, tree.children)
    next_tokens = mx.random.categorical(_without(target_logprobs, sib, valid), axis=-1)
    return choice, next_tokens.astype(mx.int32)


def verify_sampled(
    tokens: mx.array, tree: Tree, draft_logprobs: mx.array, target_logprobs: mx.array
) -> tuple[mx.array, mx.array]:
    """Exact verification of drafts sampled from q (speculative sampling).

    Chain: Leviathan et al. 2023 (arXiv 2211.17192) section 2.3 / Algorithm 1 and Chen et
    al. 2023 (arXiv 2302.01318) Algorithm 2. Tree: SpecInfer (arXiv 2305.09781) section 4.2,
    docs/acceptance.md 2.3. At a node, with r := p, child x_j drawn from q_j is accepted with
    probability min(1, r(x_j) / q_j(x_j)); on rejection r := norm(max(r - q_j, 0)) and the next
    sibling is tried; if all are rejected the resampled token comes from r; a leaf emits a
    bonus token from p. Siblings drawn without replacement must carry their adjusted q_j
    (q with earlier siblings removed, renormalised) in ``draft_logprobs``.

    Args:
        tokens (mx.array): Root-first node tokens, shape [N + 1], int32 (may be lazy).
        tree: The draft's structure.
        draft_logprobs (mx.array): log q_j each draft node was drawn from, shape [N, V], float32.
        target_logprobs (mx.array): Warped log p, shape [N + 1, V], float32.

    Returns:
        tuple[mx.array, mx.array]: ``choice`` and ``next_tokens``, both [N + 1] int32, lazy.

    Raises:
        ValueError: if the shapes disagree.
    """
    _check_shapes(tree, tokens, target_logprobs, draft_logprobs)
    children = tree.children
    sib, valid = sibling_tokens(tokens, children)
    q_rows = mx.concatenate([mx.zeros_like(draft_logprobs[:1]), mx.exp(draft_logprobs)])  # root-first
    r = mx.exp(target_logprobs)
    done = mx.zeros((tree.size + 1,), dtype=mx.bool_)
    choice = mx.zeros((tree.size + 1,), dtype=mx.int32)
    for j in range(children.shape[1]):
        child = mx.array(np.maximum(children[:, j], 0))
        x = sib[:, j : j + 1]
        q_j = q_rows[child]  # [N + 1, V]
        active = valid[:, j] & ~done
        u = mx.random.uniform(shape=(tree.size + 1,))
        accept = active & (
            u * mx.take_along_axis(q_j, x, axis=1)[:, 0] < mx.take_along_axis(r, x, axis=1)[:, 0]
        )
        choice = mx.where(accept, child, choice)
        done = done | accept
        residual = mx.maximum(r - q_j, 0.0)
        mass = residual.sum(axis=1, keepdims=True)
        update = (active & ~accept)[:, None] & (mass > 0)  # zero mass only through rounding
        r = mx.where(update, residual / mx.where(mass > 0, mass, 1.0), r)
    next_tokens = mx.random.categorical(mx.log(r), axis=-1).astype(mx.int32)
    return choice, next_tokens


def verify_typical(
    tokens: mx.array, tree: Tree, target_logits: mx.array, temp: float, threshold: float, alpha: float
) -> tuple[mx.array, mx.array]:
    """Medusa's typical acceptance — LOSSY: the output is not distributed as p.

    Cai et al. 2024 (arXiv 2401.10774), section 2.3.1; docs/acceptance.md 2.7. With
    p = softmax(logits / temp) at the parent, node x is accepted iff
    p(x) > min(threshold, alpha · exp(-H(p))), H(p) = -Σ p log(p + 1e-5), and all its
    ancestors are; the deepest accepted node wins, ties broken by the larger Σ log p
    along the path. The next token is sampled from p at that node (never the argmax,
    unlike Medusa's ``fast`` mode). Medusa's defaults are threshold 0.09, alpha 0.3.

    Args:
        tokens (mx.array): Root-first node tokens, shape [N + 1], int32.
        tree: The draft's structure.
        target_logits (mx.array): Processed target scores, shape [N + 1, V].
        temp: Temperature (> 0).
        threshold: ε, the hard probability threshold.
        alpha: δ, the entropy-scaled threshold factor.

    Returns:
        tuple[mx.array, mx.array]: ``choice`` and ``next_tokens``, both [N + 1] int32, lazy.
    """
    _check_shapes(tree, tokens, target_logits)
    scaled = target_logits.astype(mx.float32) / temp
    logprobs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    probs = mx.exp(logprobs)
    entropy = -(probs * mx.log(probs + 1e-5)).sum(axis=-1)  # [N + 1]
    parents = mx.array(np.maximum(tree.node_parents, 0))
    node_logprob = mx.take_along_axis(logprobs[parents], tokens[:, None], axis=1)[:, 0]
    cutoff = mx.minimum(threshold, alpha * mx.exp(-entropy))[parents]
    ok = (mx.exp(node_logprob) > cutoff) | (mx.arange(tree.size + 1) == 0)  # the root needs no test
    ancestors = mx.array(tree.ancestor_mask)
    on_path = mx.all(mx.where(ancestors, ok[None, :], True), axis=1)  # the whole path is accepted
    path_logprob = mx.where(
        ancestors, mx.where(mx.arange(tree.size + 1) == 0, 0.0, node_logprob)[None, :], 0.0
    ).sum(1)
    score = mx.where(on_path, mx.array(tree.depths) * 1e4 + path_logprob, -mx.inf)
    best = mx.argmax(score)
    kept = ancestors[best]  # [N + 1]: nodes on the winning path
    children = tree.children
    sib_kept = kept[mx.array(np.maximum(children, 0))] & mx.array(children >= 0)
    return _first_true(sib_kept, children), mx.random.categorical(logprobs, axis=-1).astype(mx.int32)
