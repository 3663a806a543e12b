"""KV-cache helpers over mlx-lm's caches: prefill, rewind, tree attention, compaction.

A verify round writes the root and every draft node into the cache; what the
target rejects is dropped: a chain's rejected suffix with ``trim`` (which only
lowers the offset, never copies), a tree's accepted path by gathering its rows into
place (``commit_path``). Caches that cannot be rewound or compacted exactly
(recurrent/SSM state, a wrapped rotating window) are refused before generation starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, can_trim_prompt_cache, trim_prompt_cache

from .tree import Tree

DEFAULT_PREFILL_STEP_SIZE = 2048


def check_rewindable(cache: Sequence, role: str = "target") -> None:
    """Raise unless every layer's cache can be trimmed.

    Raises:
        ValueError: naming the cache types found and the way out.
    """
    if not can_trim_prompt_cache(list(cache)):
        kinds = ", ".join(sorted({type(c).__name__ for c in cache}))
        raise ValueError(
            f"the {role} model's cache ({kinds}) cannot be rewound, so rejected drafts could not be "
            "undone; use a model with a standard KV cache, or --drafter none"
        )


def trim(cache: Sequence, num_tokens: int) -> None:
    """Drop the last ``num_tokens`` positions from every layer's cache (no copy)."""
    if num_tokens > 0:
        trim_prompt_cache(list(cache), num_tokens)


def cache_length(cache: Sequence) -> int:
    """Positions held by the first layer's cache."""
    return cache[0].offset


def prefill(
    model: nn.Module,
    cache: Sequence,
    tokens: list[int],
    step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    progress: Callable[[int, int], None] | None = None,
    hidden_tap=None,
) -> mx.array | None:
    """Run ``tokens`` into ``cache`` in chunks, evaluating only the cache state.

    Args:
        model: An mlx-lm model.
        cache: Its per-layer cache list (updated in place).
        tokens: Token ids, length [L]; may be empty.
        step_size: Tokens per forward. Default: ``2048``.
        progress: Called as ``progress(done, total)`` after each chunk.
        hidden_tap: A ``taps.HiddenTap`` on ``model``: then its features of ``tokens``
            (final hidden states, or the tapped layer inputs) are returned, shape [L, F].

    Returns:
        mx.array | None: The hidden states when ``hidden_tap`` is given.
    """
    total, hidden = len(tokens), []
    for start in range(0, total, step_size):
        chunk = mx.array(tokens[start : start + step_size], dtype=mx.int32)
        model(chunk[None], cache=cache)
        if hidden_tap is not None:
            hidden.append(hidden_tap.features()[0])
        mx.eval([c.state for c in cache], hidden)
        mx.clear_cache()
        if progress is not None:
            progress(min(start + step_size, total), total)
    if hidden_tap is not None:
        return mx.concatenate(hidden) if hidden else mx.zeros((0, 0))


def check_compactable(cache: Sequence) -> None:
    """Raise unless every layer's cache can be compacted to an accepted tree path.

    Raises:
        ValueError: naming the cache types found and the way out.
    """
    if not all(type(c) in (KVCache, QuantizedKVCache) for c in cache):
        kinds = ", ".join(sorted({type(c).__name__ for c in cache}))
        raise ValueError(
            f"the target model's cache ({kinds}) cannot be compacted to an accepted tree path; "
            "use a model with a standard KV cache, or a chain drafter (--drafter draft/ngram)"
        )


def commit_path(cache: Sequence, start: int, keep: list[int]) -> None:
    """Keep the verified positions ``start + keep[i]`` as the contiguous slots ``start + i``.

    A chain keeps a prefix, which is a trim; an accepted tree path is gathered into place
    (docs/heads.md 6.4: MLX evaluates the gathered rows before the assignment, so they do not alias).

    Args:
        cache: Per-layer caches after a verify forward wrote positions ``start, start + 1, ...``.
        start: Cache length before that forward (P).
        keep: Ascending offsets (from ``start``) of the positions to keep, root first.
    """
    n = len(keep)
    if keep == list(range(n)):
        trim(cache, cache_length(cache) - (start + n))
        return
    idx = mx.array([start + k for k in keep])

    def gather(x):
        x[..., start : start + n, :] = x[..., idx, :]
        return x

    for c in cache:
        if isinstance(c, QuantizedKVCache):
            c.keys, c.values = tuple(map(gather, c.keys)), tuple(map(gather, c.values))
        else:
            c.keys, c.values = gather(c.keys), gather(c.values)
        c.offset = start + n


class TreeRoPE(nn.Module):
    """Rotates each tree node at its own position: nodes go on the batch axis, where
    ``mx.fast.rope`` takes one offset per row (docs/heads.md 6.3, checked on mlx 0.32.4)."""

    def __init__(self, rope, depths: mx.array):
        super().__init__()
        self.rope, self.depths = rope, depths

    def __call__(self, x, offset=0):
        # x: [1, heads, T, D] -> [T, heads, 1, D]
        return self.rope(x.swapaxes(0, 2), offset=offset + self.depths).swapaxes(0, 2)


@contextmanager
def tree_attention(model: nn.Module, cache: Sequence, tree: Tree):
    """Make the next forward of ``model`` attend and rotate as a tree (SpecInfer, arXiv 2305.09781).

    Inside the block, every layer's cache hands mlx-lm the tree mask (bool
    [N + 1, P + N + 1]: the prefix is visible to all, a node sees its ancestors and
    itself), and every attention's RoPE places node n at position P + depth(n). One
    mechanism for any mlx-lm model whose attention calls ``self.rope(x, offset=...)``
    and builds its mask with ``create_attention_mask`` (llama, mistral, qwen2/3, gemma...).
    A chain needs neither and runs the model unchanged.
    """
    if tree.is_chain:
        yield
        return
    P = cache_length(cache)
    mask = mx.array(np.concatenate([np.ones((tree.size + 1, P), dtype=bool), tree.ancestor_mask], axis=1))
    depths = mx.array(tree.depths)
    owners = [m for _, m in model.named_modules() if isinstance(getattr(m, "rope", None), nn.Module)]
    originals = [m.rope for m in owners]
    for c in cache:
        c.make_mask = lambda *args, **kwargs: mask
    for owner, rope in zip(owners, originals):
        owner.rope = TreeRoPE(rope, depths)
    try:
        yield
    finally:
        for c in cache:
            del c.make_mask
        for owner, rope in zip(owners, originals):
            owner.rope = rope
