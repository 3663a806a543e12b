"""A bounded LRU of KV caches keyed by their tokens, shared by the requests of one server.

Each slot is a ``mlxspec.PromptCache`` (the target's layer caches, the tokens they hold and the
features a head drafter reads). A request takes the slot whose tokens share the longest prefix
with its prompt: when the slot's tokens are all a prefix of the prompt (the next turn of a
conversation, an agent's next call) the slot itself is handed over and extended in place; when only
part of it matches, a copy trimmed to the common prefix is handed over and the slot stays for the
request it belongs to (as mlx-lm's ``LRUPromptCache`` copies on a partial match). ``stream_generate``
then prefills only what the slot lacks. After the request the slot goes back as the most recently
used; the least recently used slots are dropped while there are more than ``slots`` or their bytes
exceed ``max_bytes``.

Every call runs on the worker thread (MLX arrays never cross threads).
"""

from __future__ import annotations

import copy

import mlx.nn as nn
import numpy as np

from ..core.cache import PromptCache, trim
from ..runtime.distributed import job_sum


def common_prefix(held: list[int], prompt: list[int]) -> int:
    """Length of the longest common prefix of ``held`` and ``prompt[:-1]`` (the prompt's last token is
    the first round's input, never cached)."""
    n = min(len(held), len(prompt) - 1)
    if n <= 0:
        return 0
    differs = np.flatnonzero(np.asarray(held[:n], dtype=np.int64) != np.asarray(prompt[:n], dtype=np.int64))
    return int(differs[0]) if differs.size else n


def cache_bytes(slot: PromptCache) -> int:
    """Bytes held by a slot's layer caches and stored features."""
    total = sum(getattr(c, "nbytes", 0) for c in slot.layers)
    return total + (slot.features.nbytes if slot.features is not None else 0)


class PrefixCache:
    """The server's prefix cache.

    Args:
        model: The target (empty slots are ``PromptCache(model)``).
        slots: Most slots kept between requests (>= 1).
        max_bytes: Most bytes the kept slots may hold together; a slot larger than this alone is not kept.

    Raises:
        ValueError: ``slots < 1`` or ``max_bytes < 0``.
    """

    def __init__(self, model: nn.Module, slots: int = 4, max_bytes: int = 2 << 30):
        if slots < 1:
            raise ValueError(f"--prefix-cache-slots must be >= 1, got {slots}")
        if max_bytes < 0:
            raise ValueError(f"--prefix-cache-gb must be >= 0, got {max_bytes / 2**30:g}")
        self.model, self.slots, self.max_bytes = model, slots, max_bytes
        self._lru: list[PromptCache] = []  # least recently used first

    def take(self, prompt: list[int]) -> PromptCache:
        """The slot to generate ``prompt`` into: the one sharing its longest prefix (in place, or a trimmed
        copy), else a new empty one. The caller gives it back with ``release`` (or drops it)."""
        best, common = None, 0
        for slot in self._lru:
            n = common_prefix(slot.tokens, prompt)
            if n > common:
                best, common = slot, n
        if best is None:
            return PromptCache(self.model)
        if common == len(best.tokens):
            self._lru.remove(best)
            return best
        return self._copy(best, common)

    def release(self, slot: PromptCache) -> None:
        """Keep ``slot`` as the most recently used; drop the least recently used over the bounds."""
        if slot in self._lru:
            self._lru.remove(slot)
        self._lru.append(slot)
        while len(self._lru) > self.slots or (self._lru and self.nbytes > self.max_bytes):
            self._lru.pop(0)

    @property
    def nbytes(self) -> int:
        """Bytes held by every kept slot; for a sharded target, by every rank's slots (one collective), so
        that every rank drops the same slots and the ranks' caches stay alike."""
        return int(job_sum(self.model, sum(cache_bytes(slot) for slot in self._lru)))

    def __len__(self) -> int:
        return len(self._lru)

    def _copy(self, slot: PromptCache, common: int) -> PromptCache:
        """A new slot holding ``slot``'s first ``common`` tokens (its layer caches copied, then trimmed)."""
        fresh = PromptCache(self.model, copy.deepcopy(slot.layers))
        trim(fresh.layers, len(slot.tokens) - common)
        fresh.tokens = slot.tokens[:common]
        fresh.feature_layers = slot.feature_layers
        fresh.features = slot.features[:common] if slot.features is not None else None
        return fresh
