"""KV-cache helpers over mlx-lm's caches: prefill, rewind, tree attention, compaction, reuse.

A verify round writes the root and every draft node into the cache; what the
target rejects is dropped: a chain's rejected suffix with ``trim`` (which only
lowers the offset, never copies), a tree's accepted path by gathering its rows into
place (``commit_path``). Every trim is checked to have removed exactly what was asked.

Sliding-window layers (mlx-lm's ``RotatingKVCache``: Gemma 2/3, gpt-oss, Ministral, llama
configs with ``layer_types``) cannot be rewound once the window wraps, so ``speculative_cache``
gives them a plain ``KVCache`` instead: mlx-lm's own window mask (``create_causal_mask`` with
``window_size``) then restricts attention exactly as the rotating cache does, and rejected
drafts can always be removed. The price is memory: those layers keep the whole context, like a
full-attention layer. Caches that cannot be rewound at all (recurrent/SSM state) are refused
before generation starts when drafting; plain decoding runs on every cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import (
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

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


def speculative_cache(model: nn.Module) -> list:
    """``make_prompt_cache(model)`` with every sliding-window layer on a rewindable ``KVCache``
    (see the module docstring: same attention, exact rewinds, full-context memory for those layers).

    Raises:
        ValueError: a rotating cache that keeps its first tokens (``keep > 0``, attention sinks),
            whose attention a plain cache and a window mask cannot reproduce.
    """
    return [rewindable(c) for c in make_prompt_cache(model)]


def rewindable(c):
    """An empty layer cache, with an empty ``RotatingKVCache`` replaced by a ``KVCache`` (others as they are).

    Raises:
        ValueError: a rotating cache with ``keep > 0``, or one that already holds tokens.
    """
    if type(c) is not RotatingKVCache:
        return c
    if c.keep:
        raise ValueError(
            f"a sliding-window cache that keeps its first {c.keep} tokens (attention sinks) cannot "
            "be rewound exactly; use --drafter none with this model"
        )
    if c.offset:
        raise ValueError("a sliding-window cache that already holds tokens cannot be made rewindable; "
                         "pass an empty cache (or a PromptCache)")
    return KVCache()


def trim(cache: Sequence, num_tokens: int) -> None:
    """Drop the last ``num_tokens`` positions from every layer's cache (no copy).

    Raises:
        RuntimeError: a layer removed fewer (mlx-lm's trims return what they removed): the cache
            would no longer match the committed tokens, so generation stops instead of going wrong.
    """
    if num_tokens > 0:
        removed = trim_prompt_cache(list(cache), num_tokens)
        if removed != num_tokens:
            kinds = ", ".join(sorted({type(c).__name__ for c in cache}))
            raise RuntimeError(f"the cache ({kinds}) removed {removed} of {num_tokens} rejected positions")


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


def commit_path(cache: Sequence, start: int, keep: list[int], written: int | None = None) -> None:
    """Keep the verified positions ``start + keep[i]`` as the contiguous slots ``start + i``.

    A chain keeps a prefix, which is a trim; an accepted tree path is gathered into place
    (docs/heads.md 6.4: MLX evaluates the gathered rows before the assignment, so they do not alias).

    Args:
        cache: Per-layer caches after a verify forward wrote positions ``start, start + 1, ...``.
        start: Cache length before that forward (P).
        keep: Ascending offsets (from ``start``) of the positions to keep, root first.
        written: Positions the forward wrote (root + drafts), when known: a round that keeps them
            all then touches no cache (plain decoding works on caches without an ``offset``).
    """
    n = len(keep)
    if keep == list(range(n)):
        if written is None or written > n:
            trim(cache, (written if written is not None else cache_length(cache) - start) - n)
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
    windowed = {}  # window size -> the tree mask restricted to keys inside each node's window

    def make_mask(*args, window_size=None, **kwargs):
        if window_size is None:
            return mask
        if window_size not in windowed:
            query = P + depths  # [N + 1] positions of the verified nodes
            key = mx.concatenate([mx.arange(P), query])  # [P + N + 1]
            windowed[window_size] = mask & (query[:, None] - key[None] < window_size)
        return windowed[window_size]

    with patched_attention(model, cache, make_mask, lambda rope: TreeRoPE(rope, depths)):
        yield


@contextmanager
def patched_attention(model: nn.Module, cache: Sequence, make_mask: Callable, wrap_rope: Callable):
    """Inside the block, every layer cache hands mlx-lm ``make_mask(...)``'s mask and every attention's RoPE
    module is ``wrap_rope(original)``; both are restored after (``tree_attention``, ``engine.batch``'s batched
    trees)."""
    owners = [m for _, m in model.named_modules() if isinstance(getattr(m, "rope", None), nn.Module)]
    originals = [m.rope for m in owners]
    for c in cache:
        c.make_mask = make_mask
    for owner, rope in zip(owners, originals):
        owner.rope = wrap_rope(rope)
    try:
        yield
    finally:
        for c in cache:
            del c.make_mask
        for owner, rope in zip(owners, originals):
            owner.rope = rope


class PromptCache:
    """The target's cache plus the tokens (and drafter features) it holds, reused across requests.

    Pass one to ``stream_generate(..., prompt_cache=...)`` for every turn of a conversation: each
    request keeps the longest common prefix of what the cache holds and its prompt, trims the
    rest, and prefills only the new tokens. Drafters that read the target's features (Medusa,
    EAGLE) get the stored features of the kept prefix, so their state is rebuilt exactly as
    after a full prefill; a draft model keeps the common prefix of its own cache the same way.

    Args:
        model: The target (its layer caches come from ``speculative_cache``).

    Attributes:
        layers: The per-layer caches (mlx-lm's list), holding ``tokens``.
        tokens: The token ids in the cache: the last request's prompt and output except its last token.
        features: The tapped target features of ``tokens``, [len(tokens), F], or ``None``.
        feature_layers: Which features those are (``Drafter.feature_layers``), or ``None``.
    """

    def __init__(self, model: nn.Module, layers: list | None = None):
        self.model = model
        self.layers = speculative_cache(model) if layers is None else layers
        self.tokens: list[int] = []
        self.features: mx.array | None = None
        self.feature_layers: tuple[int, ...] | None = None
        self.reused = 0  # tokens the last request found in the cache

    def reuse(self, prompt: list[int], feature_layers: tuple[int, ...] | None) -> int:
        """Keep the longest common prefix of ``tokens`` and ``prompt[:-1]``; return its length.

        With ``feature_layers`` (a drafter that reads features), a prefix is kept only if its
        features were stored for the same layers. A cache that cannot be trimmed starts afresh.
        """
        held = np.asarray(self.tokens[: len(prompt) - 1], dtype=np.int64)
        differs = np.flatnonzero(held != np.asarray(prompt[: len(held)], dtype=np.int64))
        common = int(differs[0]) if differs.size else len(held)
        if feature_layers is not None and (self.feature_layers != feature_layers or self.features is None):
            common = 0
        if common < len(self.tokens):
            if can_trim_prompt_cache(self.layers):
                trim(self.layers, len(self.tokens) - common)
            else:
                self.layers[:], common = speculative_cache(self.model), 0
        self.tokens = self.tokens[:common]
        self.features = self.features[:common] if self.features is not None and feature_layers else None
        self.feature_layers = feature_layers
        self.reused = common
        return common

    def add(self, tokens: list[int], features: mx.array | None) -> None:
        """Record ``tokens`` (and their features [len(tokens), F], when features are kept) as now in the
        cache."""
        self.tokens += tokens
        if self.feature_layers is not None and features is not None and features.shape[0]:
            self.features = features if self.features is None else mx.concatenate([self.features, features])


def as_prompt_cache(model: nn.Module, prompt_cache) -> PromptCache:
    """``stream_generate``'s ``prompt_cache`` argument as a ``PromptCache``.

    ``None`` → a new one; a ``PromptCache`` made for ``model`` → itself; an mlx-lm cache list → wrapped, if
    empty and shaped for ``model`` (its sliding-window layers become rewindable in place).

    Raises:
        TypeError: neither a ``PromptCache`` nor a list, or a list item that is not an mlx-lm layer cache.
        ValueError: a cache made for another model (mlx-lm pairs layers with caches with ``zip``, so a
            shorter list would silently skip layers, and another model's keys would be attended to), or a
            cache list that already holds tokens (it does not say which, so it cannot be reused safely: pass
            a ``PromptCache``).
    """
    if prompt_cache is None:
        return PromptCache(model)
    if isinstance(prompt_cache, PromptCache):
        if prompt_cache.model is not model:
            raise ValueError(
                "prompt_cache was made for another model (a PromptCache holds one model's keys and "
                "values); make one for this target with mlxspec.PromptCache(model)"
            )
        check_layers(model, prompt_cache.layers)
        return prompt_cache
    if not isinstance(prompt_cache, list):
        raise TypeError(f"prompt_cache must be a mlxspec.PromptCache or an mlx-lm cache list, got "
                        f"{type(prompt_cache).__name__}")
    check_layers(model, prompt_cache)
    if any(getattr(c, "offset", 0) or not _is_empty(c) for c in prompt_cache):
        raise ValueError(
            "prompt_cache already holds tokens from an earlier request; pass an empty cache, or a "
            "mlxspec.PromptCache, which remembers its tokens and reuses the common prefix"
        )
    prompt_cache[:] = [rewindable(c) for c in prompt_cache]
    return PromptCache(model, prompt_cache)


#: Layer caches of attention (keys and values by position): one may stand in for another.
_ATTENTION_CACHES = (KVCache, RotatingKVCache, QuantizedKVCache, ChunkedKVCache)


def check_layers(model: nn.Module, layers: Sequence) -> None:
    """Refuse layer caches that were not made for ``model``: another number of layers, or a layer whose cache
    is of another kind (a recurrent state where ``model`` attends, or the reverse).

    Raises:
        TypeError: an item that is not an mlx-lm layer cache.
        ValueError: naming the counts (or the layer and the kinds) and the fix.
    """
    expected = make_prompt_cache(model)
    if any(not isinstance(c, _BaseCache) for c in layers):
        bad = next(c for c in layers if not isinstance(c, _BaseCache))
        raise TypeError(f"prompt_cache must hold mlx-lm layer caches (make_prompt_cache(model)), got a "
                        f"{type(bad).__name__}")
    if len(layers) != len(expected):
        raise ValueError(
            f"prompt_cache has {len(layers)} layer caches but the target has {len(expected)} layers: "
            "it was made for another model; use make_prompt_cache(model) or mlxspec.PromptCache(model)"
        )
    for i, (c, e) in enumerate(zip(layers, expected)):
        same = type(c) is type(e) or (isinstance(c, _ATTENTION_CACHES) and isinstance(e, _ATTENTION_CACHES))
        if not same:
            raise ValueError(
                f"prompt_cache's layer {i} is a {type(c).__name__} but the target's is a "
                f"{type(e).__name__}: it was made for another model; use make_prompt_cache(model) or "
                "mlxspec.PromptCache(model)"
            )


def _is_empty(c) -> bool:
    empty = getattr(c, "empty", None)
    return empty() if callable(empty) else True
