"""Rows verified together: one target forward for every row's draft, each row kept by its own rule.

A batch holds the rows that are decoding; each round every row plans with its own pacer and drafts with its
own drafter (``Drafter.fork``), the target scores all rows' ``[root, *draft]`` in one forward over mlx-lm's
``BatchKVCache`` (left padding, per-row offsets), and each row's acceptance rule reads that row's logits
alone.

Why this is exact (docs/design.md, "Many requests at once"): a row's logits in the batch are the logits it
would get alone (its keys are masked to its own positions, its RoPE offsets are its own), its rule is the
single-request rule with its own random draws, and no row is ever cut short because of another: each row
commits its own accepted drafts plus its own resampled or bonus token, then the cache is compacted per row
(``commit_rows``). Rows with shorter drafts are padded; the padding is written and then dropped, and no real
node attends to it. So every row's output is distributed exactly as it would be alone, and at temperature 0
equals plain greedy decoding up to float32 rounding of batched matmuls.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..core.cache import PromptCache, patched_attention
from ..core.metrics import RoundStats
from ..core.sampling import SamplingParams
from ..core.stops import StopStrings
from ..core.tree import Tree
from ..drafters import Draft, Drafter, Plan
from ..pacing import BatchGate, Pacer
from .batch_draft import DraftRows
from .generate import accepted_path, cut_round, judge

#: Rounds between two shifts of the batch's cache past the padding every row shares.
SHIFT_EVERY = 32


def batchable_layers(layers: list) -> bool:
    """Whether a target's layer caches (``make_prompt_cache``: as mlx-lm makes them, before sliding windows
    are made rewindable) can live in a ``BatchKVCache``: plain attention caches only (a window mask is not
    applied to a batch's tree mask)."""
    return bool(layers) and all(type(c) is KVCache for c in layers)


@dataclass
class Row:
    """One generation in the batch.

    Attributes:
        history: Committed tokens (prompt + output); the last is the next round's root.
        drafter, pacer: This row's own (``Drafter.fork``; ``pacing.make_pacer``).
        sampling, rule: Its sampling settings and acceptance rule (``generate.make_verifier``).
        stop_tokens, stopper: Ids and the ``StopStrings`` that end it.
        max_tokens: Most tokens to generate.
        store: Its ``PromptCache``: the tokens (and features) its cache holds; the layers themselves live in
            the batch while it runs and go back to the store when it leaves.
        seed: Seeds this row's random stream (drafting and acceptance draws), independent of its neighbours.
    """

    history: list[int]
    drafter: Drafter
    pacer: Pacer
    sampling: SamplingParams
    rule: object
    stop_tokens: set[int]
    stopper: StopStrings | None
    max_tokens: int
    store: PromptCache
    seed: int
    generated: int = 0
    rounds: int = 0

    def __post_init__(self):
        self._random = np.random.default_rng(self.seed)

    @property
    def room(self) -> int:
        return self.max_tokens - self.generated

    def reseed(self) -> None:
        """Point ``mx.random`` at this row's stream (before any of its random draws)."""
        mx.random.seed(int(self._random.integers(2**63)))

    def plan(self) -> Plan:
        """The pacer's next plan, never drafting past the tokens left (as ``generate._Rounds.plan``)."""
        plan, room = self.pacer.plan(), self.room - 1
        return plan if plan.gamma <= room else Plan(max(room, 0), plan.keep_above, plan.budget, plan.select)


@dataclass(frozen=True)
class RowRound:
    """What one round committed for one row: tokens, their kinds, the round's stats and why the row ends."""

    row: Row
    tokens: list[int]
    kinds: list[str]
    stats: RoundStats
    finish_reason: str | None


class Batch:
    """The decoding rows and their target caches, one ``BatchKVCache`` per layer.

    Args:
        model: The target.
        tap: A ``taps.HiddenTap`` on it when the rows' drafters read its features, else ``None``.
    """

    def __init__(self, model: nn.Module, tap=None):
        self.model, self.tap = model, tap
        self.rows: list[Row] = []
        self.layers: list[BatchKVCache] | None = None
        self.gate = BatchGate()
        self.draft_rows = DraftRows()
        self._rounds = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: Row) -> None:
        """Join ``row``, whose store's layers hold its prefilled prompt (all but the last token)."""
        single = [BatchKVCache.merge([c]) for c in row.store.layers]
        if self.layers is None:
            self.layers = single
        else:
            for layer, new in zip(self.layers, single):
                layer.extend(new)
        self.rows.append(row)

    def remove(self, row: Row) -> None:
        """Let ``row`` leave; its store gets its layer caches back (for a prefix cache to keep)."""
        i = self.rows.index(row)
        row.store.layers[:] = [_extract(layer, i) for layer in self.layers]
        self.draft_rows.leave(row.drafter)
        # a lazy copy would hold the batch's buffers
        mx.eval([c.state for c in row.store.layers if c.keys is not None])
        self.rows.pop(i)
        if not self.rows:
            self.layers = None
            mx.clear_cache()  # the batch's buffers go back to the system while it is empty
            return
        keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
        for layer in self.layers:
            layer.filter(keep)

    def round(self) -> list[RowRound]:
        """One round for every row: plan → propose → one forward → each row's rule → one sync → commit."""
        plans = self.gate.admit([row.pacer for row in self.rows], [row.plan() for row in self.rows],
                                [self.draft_rows.takes(row.drafter) for row in self.rows])
        drafts, draft_s = self.propose(plans)
        t1 = time.perf_counter()
        width = 1 + max(draft.size for draft in drafts)  # T: the widest row's root + draft
        tokens = mx.stack([_padded(row.history[-1], draft, width) for row, draft in zip(self.rows, drafts)])
        with batch_tree_attention(self.model, self.layers, [draft.tree for draft in drafts], width):
            logits = self.model(tokens, cache=self.layers)  # [B, T, V]
        hidden = self.tap.features() if self.tap is not None else None  # [B, T, F]
        judged = []
        for b, (row, draft) in enumerate(zip(self.rows, drafts)):
            n = draft.size + 1
            row.reseed()
            judged.append(judge(row.history, tokens[b, :n], draft, logits[b, :n], row.sampling, row.rule))
        mx.eval(judged, [draft.tokens for draft in drafts], hidden)
        verify_s = time.perf_counter() - t1
        out, kept, paths = [], [], []
        outcomes = self.outcomes(drafts, judged, logits)
        rounds = zip(self.rows, drafts, draft_s, plans, outcomes)
        for row, draft, seconds, plan, (path, round_tokens, kinds) in rounds:
            keep, finish_reason = cut_round(round_tokens, row.stop_tokens, row.room, row.stopper)
            kept.append(([0] + path)[:keep])  # root-first nodes whose positions stay in the cache
            paths.append(path[:keep])  # accepted nodes whose tokens were committed
            stats = RoundStats(row.rounds, draft.size, min(len(path), keep), keep, seconds, verify_s,
                               int(draft.tree.depths.max()) if draft.size else 0, tuple(n - 1 for n in path),
                               plan.gamma if plan.keep_above is None else draft.size, rows=len(self.rows))
            out.append(RowRound(row, round_tokens[:keep], kinds[:keep], stats, finish_reason))
        commit_rows(self.layers, kept, width)
        for b, (result, draft) in enumerate(zip(out, drafts)):
            row = result.row
            features = hidden[b, : draft.size + 1] if hidden is not None else None  # [N + 1, F]
            kept_features = None
            if features is not None and row.store.feature_layers is not None:
                kept_features = features[mx.array(kept[b])]
            row.store.add(row.history[-1:] + result.tokens[:-1], kept_features)
            row.history += result.tokens
            row.drafter.commit(len(row.history), [node - 1 for node in paths[b]], features)
            row.pacer.observe(result.stats, draft)
            row.generated += len(result.tokens)
            row.rounds += 1
        self._rounds += 1
        if self._rounds % SHIFT_EVERY == 0:
            self._shift()
        if self._rounds % 64 == 0:
            mx.clear_cache()
        return out

    def propose(self, plans: list[Plan]) -> tuple[list[Draft], list[float]]:
        """Each row's draft for its plan, and its seconds of drafting. Draft-model rows draft together, one
        forward per draft token for all (``batch_draft.DraftRows``; each a share of that time); the others one
        by one."""
        start = time.perf_counter()
        together = self.draft_rows.propose(self.rows, plans)
        shared_s = (time.perf_counter() - start) / max(len(together), 1)
        drafts, draft_s = [], []
        for b, (row, plan) in enumerate(zip(self.rows, plans)):
            if b in together:
                drafts.append(plan.select(together[b]))
                draft_s.append(shared_s)
                continue
            start = time.perf_counter()
            row.reseed()
            draft = Draft.empty() if plan.gamma == 0 else plan.select(
                row.drafter.propose(row.history, plan.gamma, row.sampling, plan))
            drafts.append(draft)
            draft_s.append(time.perf_counter() - start)
        return drafts, draft_s

    def outcomes(self, drafts: list[Draft], judged: list, logits: mx.array) -> list[tuple]:
        """Each row's own outcome, ``generate.accepted_path`` of its own rule's choice: ``(path, tokens,
        kinds)``; no row is cut short by another (the module docstring says why every row stays exact)."""
        return [accepted_path(draft, choice.tolist(), next_tokens.tolist())
                for draft, (choice, next_tokens) in zip(drafts, judged)]

    def _shift(self) -> None:
        """Drop the left padding every row shares (``BatchKVCache.filter`` shifts it away)."""
        everyone = mx.arange(len(self.rows))
        for layer in self.layers:
            layer.filter(everyone)


def _extract(layer: BatchKVCache, i: int) -> KVCache:
    """Row ``i`` of a batch cache as a plain ``KVCache`` (empty when the batch holds no keys yet)."""
    if layer.keys is None:
        return KVCache()
    return layer.extract(i)


def _padded(root: int, draft: Draft, width: int) -> mx.array:
    """``[root, *draft.tokens]`` padded with zeros to ``width`` tokens, int32 [T]."""
    parts = [mx.array([root], dtype=mx.int32), draft.tokens.astype(mx.int32)]
    if width > draft.size + 1:
        parts.append(mx.zeros((width - draft.size - 1,), dtype=mx.int32))
    return mx.concatenate(parts)


def commit_rows(layers: list[BatchKVCache], kept: list[list[int]], written: int) -> None:
    """Keep, in each row, the verified positions ``kept[b]`` of the last ``written`` ones, contiguously last.

    Row b's kept positions (offsets from the first written one, ascending, root first) move to the end of the
    committed region and everything before them shifts right by what the row dropped, which becomes left
    padding: one gather per layer (``BatchKVCache.finalize`` does the same roll for right-padded prompts).
    What every row dropped is trimmed first, so a round that keeps all of every row (a plain step) copies
    nothing.

    Args:
        layers: The batch's caches after a forward wrote ``written`` positions per row.
        kept: Per row, the kept offsets in ``[0, written)``, root first.
        written: Positions the forward wrote per row (T).
    """
    dropped = [written - len(k) for k in kept]
    common = min(dropped)
    if common:
        for layer in layers:
            layer.trim(common)
    end = layers[0]._idx  # the batch's write position after the trim
    start = end + common - written  # where this round's first written position sits
    identity = all(k == list(range(len(k))) and d == common for k, d in zip(kept, dropped))
    if identity:
        return
    capacity = layers[0].keys.shape[2]
    index = np.tile(np.arange(capacity, dtype=np.int32), (len(kept), 1))  # [B, capacity]
    shifts = np.zeros(len(kept), dtype=np.int32)
    for b, (k, d) in enumerate(zip(kept, dropped)):
        shift = d - common
        shifts[b] = shift
        index[b, shift:start + shift] = np.arange(start)  # the committed prefix, moved right
        index[b, start + shift:end] = start + np.asarray(k, dtype=np.int32)  # this round's kept positions
        index[b, :shift] = 0  # new left padding
    gather = mx.array(index)[:, None, :, None]  # [B, 1, capacity, 1]
    shifts = mx.array(shifts)
    for layer in layers:
        layer.keys = mx.take_along_axis(layer.keys, gather, axis=2)
        layer.values = mx.take_along_axis(layer.values, gather, axis=2)
        layer.left_padding = layer.left_padding + shifts
        layer.offset = layer.offset - shifts


class BatchTreeRoPE(nn.Module):
    """Rotates node t of row b at its own position ``positions[b, t]``: every (row, node) goes on the batch
    axis, where ``mx.fast.rope`` takes one offset per row (as ``cache.TreeRoPE`` does for one row)."""

    def __init__(self, rope, positions: mx.array):
        super().__init__()
        self.rope, self.positions = rope, positions

    def __call__(self, x, offset=0):
        B, H, T, D = x.shape
        y = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)  # [B·T, H, 1, D]
        y = self.rope(y, offset=self.positions.reshape(-1))
        return y.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # [B, H, T, D]


@contextmanager
def batch_tree_attention(model: nn.Module, layers: list[BatchKVCache], trees: list[Tree], width: int):
    """Make the next forward attend and rotate each row as its own tree (a batch's ``cache.tree_attention``).

    Chains need nothing: the batch cache's causal mask with left padding is each chain's ancestor mask, and a
    row's padding comes after its real nodes, which never see it. With a tree among the rows, every layer
    hands mlx-lm the mask bool [B, 1, T, P + T] (a row's own prefix, then its ancestors; a padding node sees
    itself) and every RoPE places node t of row b at ``offset[b] + depth``.
    """
    if all(tree.is_chain for tree in trees):
        yield
        return
    first = layers[0]
    P = first._idx
    ancestors = np.zeros((len(trees), width, width), dtype=bool)
    depths = np.zeros((len(trees), width), dtype=np.int32)
    for b, tree in enumerate(trees):
        n = tree.size + 1
        ancestors[b] = np.eye(width, dtype=bool)
        ancestors[b, :n, :n] = tree.ancestor_mask
        depths[b, :n] = tree.depths
    prefix = mx.arange(P)[None] >= first.left_padding[:, None]  # [B, P]
    prefix = mx.broadcast_to(prefix[:, None, :], (len(trees), width, P))
    mask = mx.concatenate([prefix, mx.array(ancestors)], axis=2)[:, None]  # [B, 1, T, P + T]
    positions = first.offset[:, None] + mx.array(depths)  # [B, T]
    rotate = lambda rope: BatchTreeRoPE(rope, positions)  # noqa: E731
    with patched_attention(model, layers, lambda *args, **kwargs: mask, rotate):
        yield
