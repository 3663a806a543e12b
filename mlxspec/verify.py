"""Acceptance rules for a drafted chain: pure array functions, no host sync.

Each rule returns lazy arrays ``(num_accepted, next_tokens)``: the number of
drafts that survive, and for every position ``i`` the token emitted if the
chain stops there (row ``K`` is the bonus token). The caller evaluates both in
its one blocking sync per round and picks ``next_tokens[num_accepted]``, so a
rejection never costs a second round trip.

Letters: p is the target's (warped) distribution, q the drafter's.
"""

from __future__ import annotations

import mlx.core as mx


def _check_shapes(draft_tokens: mx.array, target: mx.array, draft_logprobs: mx.array | None = None):
    K = draft_tokens.shape[0]
    if target.ndim != 2 or target.shape[0] != K + 1:
        raise ValueError(f"target scores must have shape [K + 1, V] = [{K + 1}, V], got {target.shape}")
    if draft_logprobs is not None and draft_logprobs.shape != (K, target.shape[1]):
        raise ValueError(
            f"draft log-probs must have shape [K, V] = [{K}, {target.shape[1]}], got {draft_logprobs.shape}"
        )


def _count_accepted(accepted: mx.array) -> mx.array:
    """Length of the all-True prefix of a [K] bool vector, as an int32 scalar."""
    return mx.cumprod(accepted.astype(mx.int32)).sum()


def verify_greedy(draft_tokens: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verification: keep the longest prefix that equals the target's argmax.

    With temperature 0 the output is token for token what plain greedy decoding
    gives (Leviathan et al. 2023, section 2.3, the ``temp -> 0`` limit).

    Args:
        draft_tokens (mx.array): Drafted ids, shape [K], int32.
        target_logits (mx.array): Processed target scores, shape [K + 1, V]; row ``i``
            scores the position after the root and ``draft_tokens[:i]``.

    Returns:
        tuple[mx.array, mx.array]: ``num_accepted`` (int32 scalar) and the target's
        argmax at every position, shape [K + 1], int32. Both lazy.

    Raises:
        ValueError: if the shapes disagree.
    """
    _check_shapes(draft_tokens, target_logits)
    target_tokens = mx.argmax(target_logits, axis=-1).astype(mx.int32)
    K = draft_tokens.shape[0]
    return _count_accepted(draft_tokens == target_tokens[:K]), target_tokens


def residual_logprobs(
    draft_tokens: mx.array, draft_logprobs: mx.array | None, target_logprobs: mx.array
) -> mx.array:
    """log norm(max(p - q, 0)) at each drafted position.

    For a deterministic drafter (q one-hot on the drafted token) this is p with the
    drafted token removed, renormalised.

    Args:
        draft_tokens (mx.array): Drafted ids, shape [K], int32.
        draft_logprobs (mx.array | None): log q, shape [K, V], float32; ``None`` = one-hot.
        target_logprobs (mx.array): log p, shape [K, V], float32.

    Returns:
        mx.array: Residual log-probabilities, shape [K, V], float32. A row whose
        residual is empty (p == q) is all ``-inf``; it is never sampled from,
        because then the draft is accepted with probability 1.
    """
    if draft_logprobs is None:
        V = target_logprobs.shape[-1]
        is_drafted = mx.arange(V)[None, :] == draft_tokens[:, None]
        residual = mx.where(is_drafted, -mx.inf, target_logprobs)
    else:
        diff = mx.maximum(mx.exp(target_logprobs) - mx.exp(draft_logprobs), 0.0)
        residual = mx.log(diff)
    return residual - mx.logsumexp(residual, axis=-1, keepdims=True)


def verify_rejection(
    draft_tokens: mx.array,
    draft_logprobs: mx.array | None,
    target_logprobs: mx.array,
) -> tuple[mx.array, mx.array]:
    """Speculative (rejection) sampling: the output is distributed exactly as p.

    Leviathan et al. 2023 (arXiv 2211.17192), section 2.3 and Algorithm 1;
    Chen et al. 2023 (arXiv 2302.01318), Algorithm 2. Draft ``x_i`` is accepted
    with probability ``min(1, p(x_i) / q(x_i))``; at the first rejection the token
    comes from the residual ``norm(max(p - q, 0))``; when all K survive, a bonus
    token comes from ``p`` at position K. A deterministic drafter (``q`` one-hot)
    is accepted with probability ``p(x_i)``.

    Args:
        draft_tokens (mx.array): Drafted ids, shape [K], int32.
        draft_logprobs (mx.array | None): log q each draft was sampled from, shape
            [K, V], float32; ``None`` means a deterministic (one-hot) proposal.
        target_logprobs (mx.array): Warped log p, shape [K + 1, V], float32.

    Returns:
        tuple[mx.array, mx.array]: ``num_accepted`` (int32 scalar) and, per position,
        a resampled token (rows ``0..K-1``) or the bonus token (row ``K``), shape
        [K + 1], int32. Both lazy; random draws use ``mx.random``'s global state.

    Raises:
        ValueError: if the shapes disagree.
    """
    _check_shapes(draft_tokens, target_logprobs, draft_logprobs)
    K = draft_tokens.shape[0]
    if K == 0:  # a plain decoding step
        return mx.array(0, dtype=mx.int32), mx.random.categorical(target_logprobs, axis=-1).astype(mx.int32)
    p_logprobs = target_logprobs[:K]
    log_ratio = mx.take_along_axis(p_logprobs, draft_tokens[:, None], axis=-1)[:, 0]
    if draft_logprobs is not None:
        log_ratio = log_ratio - mx.take_along_axis(draft_logprobs, draft_tokens[:, None], axis=-1)[:, 0]
    u = mx.random.uniform(shape=(K,))
    accepted = mx.log(u) < log_ratio
    residual = residual_logprobs(draft_tokens, draft_logprobs, p_logprobs)
    candidates = mx.concatenate([residual, target_logprobs[K:]], axis=0)
    next_tokens = mx.random.categorical(candidates, axis=-1).astype(mx.int32)
    return _count_accepted(accepted), next_tokens
