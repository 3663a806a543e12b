"""Draft-model rows drafted together: one draft-model forward per draft token for every row of a batch.

Each row of ``engine.batch`` drafts with its own fork of a ``DraftModelDrafter``; one by one that is R
single-row forwards per draft token, R times what one batched forward costs on a memory-bound device.
``DraftRows`` keeps the forks' caches as the rows of one mlx-lm ``BatchKVCache`` per draft layer (left
padding, per-row offsets) and drafts every row's k-th token in one forward.

A round: rows new to the target batch bring their prefilled caches (``extend``); each row drops what its
``commit`` rejected last round (its last positions: one roll per layer, mlx-lm's
``prepare(right_padding=...)`` and ``finalize``, as a right-padded prompt is rolled); each row feeds the
committed tokens its cache lacks (the root, the last draft when all were accepted, more after plain rounds),
right-padded to the longest, the padding rolled out the same way; then one forward per draft token. A row
leaves when it leaves the target batch (``leave``).

Why each row stays exact: its logits are its logits alone (its own keys, its own RoPE offsets; padding is
never attended by a real position, then dropped); its k-th token is drawn from its own q (its sampling, logits
processors and draft vocabulary) with the key the single-row drafter's k-th draw would use under its own
stream (``Row.reseed``), and q is returned as that drafter returns it. Rows draft together until the last one
stops: each at its own γ or, with ``Plan.keep_above`` (γ auto), where its own confidence rule stops (one host
read per token for all, as one row alone reads its own); a row that stopped goes on drafting with the others
and is cut there: the rule decides on token k + 1 from the confidences of tokens 1..k, never from the token it
decides about, so drafting further and cutting gives the same draft as stopping. Rows of another drafter,
or of a draft model whose caches are not all plain ``KVCache``s (sliding windows), draft one by one.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from ..core.sampling import SamplingParams, process_logits, warp
from ..drafters import Draft, Plan
from ..drafters.draft_model import DraftModelDrafter, log_confidence

#: Proposals between two shifts of the draft cache past the left padding every row shares.
SHIFT_EVERY = 32


class RowCache:
    """One row of the batch's draft cache, standing in as its fork's ``cache`` while the fork drafts in the
    batch: ``offset`` is the row's length, and ``trim(n)`` (what ``DraftModelDrafter.commit`` calls) marks the
    row's last ``n`` positions dropped; ``DraftRows`` drops every row's at once before its next forward."""

    def __init__(self, offset: int):
        self.offset, self.dropped = offset, 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset, self.dropped = self.offset - n, self.dropped + n
        return n


class DraftRows:
    """The batch's draft-model rows and their draft cache, one ``BatchKVCache`` per layer of the draft model.

    Attributes:
        enabled: Whether rows draft together (``False``: every row drafts alone, to measure what this saves).
        forwards: Draft-model forwards run for the batch so far.
    """

    enabled = True

    def __init__(self):
        self.model = None  # the draft model every member's fork shares
        self.members: list[DraftModelDrafter] = []
        self.rows: list[RowCache] = []
        self.layers: list[BatchKVCache] | None = None
        self.forwards = 0
        self._proposals = 0

    def takes(self, drafter) -> bool:
        """Whether ``drafter`` drafts here: a ``DraftModelDrafter`` fork of the draft model already here (the
        first one fixes it), whose layer caches are plain ``KVCache``s."""
        if not self.enabled or type(drafter) is not DraftModelDrafter:
            return False
        if self.model is None and all(type(c) is KVCache for c in make_prompt_cache(drafter.model)):
            self.model = drafter.model
        return drafter.model is self.model

    def propose(self, rows: list, plans: list[Plan]) -> dict[int, Draft]:
        """Draft together every row of ``rows`` (``batch.Row``s) that plans γ > 0 and whose drafter ``takes``.

        Returns:
            dict: index in ``rows`` → that row's ``Draft`` (tokens [γ_r] int32, q [γ_r, V] float32 or ``None``
            when greedy, survival [γ_r]), as its drafter's own ``propose`` would return it; empty when none
            drafts here.
        """
        chosen = [b for b, (row, plan) in enumerate(zip(rows, plans))
                  if plan.gamma > 0 and self.takes(row.drafter)]
        if not chosen:
            return {}
        for b in chosen:
            self._join(rows[b].drafter)
        self._drop([row.dropped for row in self.rows])  # what each row's commit rejected last round
        for row in self.rows:
            row.dropped = 0
        member = {b: self._index(rows[b].drafter) for b in chosen}
        fed = [[] for _ in self.members]
        for b in chosen:
            fed[member[b]] = rows[b].drafter.unseen(rows[b].history)
        out = self._feed(fed)  # [B, V_draft or H]: each row's output after its last fed token
        depth = max(plans[b].gamma for b in chosen)
        keys = {b: _keys(rows[b], depth) for b in chosen}
        contexts = {b: mx.array(rows[b].history, dtype=mx.int32) for b in chosen}
        processors = {b: rows[b].sampling.processors() for b in chosen}
        drawn = {b: ([], [], []) for b in chosen}  # tokens [1], log q [1, V] or None, log confidence [1]
        sizes = {b: plans[b].gamma for b in chosen}  # each row's draft length: its γ, or its confidence stop
        survival = {b: 0.0 for b in chosen if plans[b].keep_above is not None}  # log survival so far
        for k in range(depth):
            step = [mx.zeros((1,), dtype=mx.int32)] * len(self.members)  # padding for rows not drafting
            for b in chosen:
                row, i, (tokens, logprobs, confidence) = rows[b], member[b], drawn[b]
                logits = row.drafter.to_logits(out[i : i + 1])  # [1, V]
                if processors[b]:
                    logits = process_logits(logits, mx.concatenate([contexts[b], *tokens]), processors[b])
                token, token_logprobs = _draw(logits, row.sampling, keys[b][k])
                tokens.append(token)
                logprobs.append(token_logprobs)
                confidence.append(log_confidence(logits if token_logprobs is None else token_logprobs))
                step[i] = token
            _stop(sizes, plans, drawn, survival, k)
            if k + 1 >= max(sizes.values()):
                break
            out = self._forward(mx.concatenate(step)[:, None])[:, -1]
        for row in self.rows:
            row.offset += k  # the forwards after the feed
        return {b: self._draft(rows[b], sizes[b], *drawn[b]) for b in chosen}

    def leave(self, drafter) -> None:
        """Take ``drafter``'s row out (its row left the target batch); it gets a cache of its own back."""
        i = self._index(drafter)
        if i is None:
            return
        layers = [_extract(layer, i) for layer in self.layers]
        for layer in layers:
            layer.trim(self.rows[i].dropped)
        drafter.cache = layers
        self.members.pop(i)
        self.rows.pop(i)
        if not self.members:
            self.layers = None
            return
        keep = mx.array([j for j in range(len(self.members) + 1) if j != i])
        for layer in self.layers:
            layer.filter(keep)

    def _index(self, drafter) -> int | None:
        return next((i for i, m in enumerate(self.members) if m is drafter), None)

    def _join(self, drafter: DraftModelDrafter) -> None:
        """Make ``drafter`` a row, its prefilled cache moving into the batch's."""
        if self._index(drafter) is not None:
            return
        single = [BatchKVCache.merge([c]) for c in drafter.cache]
        if self.layers is None:
            self.layers = single
        else:
            for layer, new in zip(self.layers, single):
                layer.extend(new)
        row = RowCache(drafter.cache[0].offset)
        drafter.cache = [row]
        self.members.append(drafter)
        self.rows.append(row)

    def _forward(self, tokens: mx.array) -> mx.array:
        """The draft model on ``tokens`` [B, T] int32 through the batch's cache: [B, T, V_draft or H]."""
        self.forwards += 1
        return self.members[0].forward(tokens, self.layers)

    def _feed(self, fed: list[list[int]]) -> mx.array:
        """Feed row b's ``fed[b]`` (right-padded to the longest, the padding then dropped); each row's output
        after its last fed token [B, V_draft or H] (a row fed nothing gets its padding's, unused)."""
        width = max(len(tokens) for tokens in fed)
        inputs = mx.array([tokens + [0] * (width - len(tokens)) for tokens in fed], dtype=mx.int32)  # [B, T]
        out = self._forward(inputs)
        out = out[mx.arange(len(fed)), mx.array([max(len(tokens) - 1, 0) for tokens in fed])]
        self._drop([width - len(tokens) for tokens in fed])
        for row, tokens in zip(self.rows, fed):
            row.offset += len(tokens)
        self._proposals += 1
        if self._proposals % SHIFT_EVERY == 0:
            everyone = mx.arange(len(self.members))
            for layer in self.layers:
                layer.filter(everyone)  # drops the left padding every row shares
        return out

    def _drop(self, drops: list[int]) -> None:
        """Drop row b's last ``drops[b]`` positions: what every row drops is trimmed, the rest rolled out per
        row (each row stays right-aligned; what it dropped becomes left padding)."""
        common = min(drops)
        rest = [d - common for d in drops]
        for layer in self.layers:
            layer.trim(common)
            if any(rest):
                layer.prepare(right_padding=rest)
                layer.finalize()

    def _draft(self, row, size: int, tokens: list, logprobs: list, confidence: list) -> Draft:
        """Row ``row``'s draft of its first ``size`` drawn tokens, as its own ``propose`` returns one."""
        drafted = mx.concatenate(tokens[:size])
        row.drafter.proposed(row.history, drafted)
        q = None if row.sampling.greedy else mx.concatenate(logprobs[:size], axis=0)
        survival = mx.exp(mx.cumsum(mx.concatenate(confidence[:size])))  # lazy: only scheduling reads it
        return Draft.chain(drafted, q, survival)


def _stop(sizes: dict, plans: list[Plan], drawn: dict, survival: dict, k: int) -> None:
    """After token k + 1: end the drafts of the rows whose confidence rule (``Plan.keep_above``, γ auto) stops
    there, as their single-row ``propose`` would (the same rule on the same confidences, read once for all
    rows as one row reads its own each token). The rule never reads the token it decides about, so a row
    drafted further with the others and cut here has the same draft as one that stopped."""
    going = [b for b in survival if k + 1 < sizes[b]]
    if not going:
        return
    for b, c in zip(going, mx.concatenate([drawn[b][2][-1] for b in going]).tolist()):
        survival[b] += c
        if math.exp(survival[b]) <= plans[b].keep_above[k]:
            sizes[b] = k + 1


def _keys(row, n: int) -> list[mx.array]:
    """The keys of the first ``n`` draws of ``row``'s stream this round (``Row.reseed``, then mlx's global key
    sequence: each draw splits the key into the next key and the draw's)."""
    row.reseed()
    key, keys = mx.random.state[0], []
    for _ in range(n):
        key, draw = mx.random.split(key)
        keys.append(draw)
    return keys


def _draw(logits: mx.array, sampling: SamplingParams, key: mx.array) -> tuple[mx.array, mx.array | None]:
    """``sampling.sample`` with the draw's key: token [1] int32 and log q [1, V] float32 (``None`` when
    greedy)."""
    if sampling.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32), None
    logprobs = warp(logits, sampling)
    return mx.random.categorical(logprobs, axis=-1, key=key).astype(mx.int32), logprobs


def _extract(layer: BatchKVCache, i: int) -> KVCache:
    """Row ``i`` of a batch cache as a plain ``KVCache`` (empty when the batch holds no keys yet)."""
    return KVCache() if layer.keys is None else layer.extract(i)
