"""KV-cache helpers over mlx-lm's caches: prefill, rewind, and the up-front check.

A verify round writes the root and every draft into the cache; what the target
rejects is rewound with ``trim`` (which only lowers the offset, never copies).
Caches that cannot be rewound exactly (recurrent/SSM state, a wrapped rotating
window) are refused before generation starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

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
) -> None:
    """Run ``tokens`` into ``cache`` in chunks, evaluating only the cache state.

    Args:
        model: An mlx-lm model.
        cache: Its per-layer cache list (updated in place).
        tokens: Token ids, length [L]; may be empty.
        step_size: Tokens per forward. Default: ``2048``.
        progress: Called as ``progress(done, total)`` after each chunk.
    """
    total = len(tokens)
    for start in range(0, total, step_size):
        chunk = mx.array(tokens[start : start + step_size], dtype=mx.int32)
        model(chunk[None], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
        if progress is not None:
            progress(min(start + step_size, total), total)
