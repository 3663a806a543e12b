"""Draft-model distillation's settings and data: the config, the held-out record, corpus chunks,
example ranges, packing, the held-out split and the training vocabulary (``mlxspec.train.draft``
trains on them).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .features import FeatureCache
from .loop import EvalRecord, TrainConfig


CORPUS_KEYS = ("tokens", "mask", "offsets", "topk_ids", "topk_logprobs")
#: Settings that must match to resume a run (with the loop's own).
RESUME_KEYS = ("layers", "hidden", "heads", "kv_heads", "intermediate_size", "batch_tokens", "max_seq_length",
               "heldout_examples", "train_vocab")


@dataclass(frozen=True)
class DraftTrainConfig(TrainConfig):
    """Settings of a draft-model distillation run: the loop's (``TrainConfig``) and these.

    Attributes:
        layers: Decoder layers of the draft.
        hidden: Hidden size H of the draft.
        heads: Attention heads (``None``: H / the target's head size, at least 1).
        kv_heads: Key/value heads (``None``: keep the target's query/KV ratio where it divides).
        intermediate_size: MLP width (``None``: the target's ratio to H, rounded to a multiple of 64).
        batch_tokens: Tokens per step, padding included (B × T ≤ this; one example may exceed it alone).
        max_seq_length: Examples are cut to this many tokens (prompt + answer).
        heldout_examples: With no held-out corpus, hold out this many examples from the end of the
            training corpus (never trained on).
        train_vocab: Normalise q in the *training* loss over only the this-many tokens that appear most
            often among the corpus's soft labels, plus ``negatives`` tokens drawn uniformly from the rest
            each step (0: the full vocabulary). Sampled softmax (Jean et al. 2015, arXiv 1412.2007): the
            rest's share of the normaliser is estimated from the sample (each sampled logit counts
            (V − C) / negatives times), so their logits are still pushed down; the LM head and softmax,
            most of a step on a CPU, shrink by about V / (C + negatives). Soft labels outside the set
            are dropped and the rest renormalised. The draft keeps its full LM head; the held-out
            scores use the full vocabulary.
        negatives: Tokens sampled per step from outside the training vocabulary (with ``train_vocab``).
    """

    layers: int = 4
    hidden: int = 256
    heads: int | None = None
    kv_heads: int | None = None
    intermediate_size: int | None = None
    batch_tokens: int = 2048
    max_seq_length: int = 512
    heldout_examples: int = 32
    train_vocab: int = 0
    negatives: int = 2048

    def __post_init__(self):
        super().__post_init__()
        for name in ("layers", "hidden", "batch_tokens", "max_seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("heads", "kv_heads", "intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("heldout_examples", "train_vocab", "negatives"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class DraftEvalRecord(EvalRecord):
    """Held-out scores after ``epoch`` epochs (0 = before training; a budget-stopped epoch counts).

    Attributes:
        kl: Mean KL(p̃ || q), nats, p̃ the renormalised top-K soft labels.
        alpha: Mean Σ_{x in top K} min(p(x), q(x)): expected acceptance at temperature 1 under the target,
            top-K approximate (a lower bound: the tail beyond the K soft labels is left out).
        top1: Fraction of positions where the draft's argmax equals the target's (α at temperature 0).
        positions: Held-out positions scored.
    """

    kl: float
    alpha: float
    top1: float
    positions: int


# --- data ----------------------------------------------------------------------------------------------


def load_corpus_chunk(cache: FeatureCache, c: int) -> dict[str, np.ndarray]:
    """The arrays of chunk ``c`` a draft needs (not the large hidden-state features).

    Raises:
        ValueError: the folder is not a corpus with soft labels (``mlxspec train corpus``).
    """
    return cache.load_arrays(c, CORPUS_KEYS)


def example_ranges(arrays: dict, max_seq_length: int) -> list[tuple[int, int]]:
    """``(start, end)`` token ranges of the chunk's examples, cut to ``max_seq_length``, that keep at
    least one loss position (a token t whose next token is an answer token)."""
    offsets, mask = arrays["offsets"], arrays["mask"]
    out = []
    for lo, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        hi = min(end, lo + max_seq_length)
        if mask[lo + 1 : min(hi + 1, end)].any():  # row t predicts token t + 1
            out.append((lo, hi))
    return out


def pack_examples(ranges: list[tuple[int, int]], batch_tokens: int) -> list[list[tuple[int, int]]]:
    """Consecutive groups with (examples × longest) ≤ ``batch_tokens`` (an example alone may exceed it)."""
    groups, current, longest = [], [], 0
    for lo, hi in ranges:
        n = hi - lo
        if current and max(longest, n) * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append((lo, hi))
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def plan_epoch(ranges: list[tuple[int, int]], batch_tokens: int, rng: np.random.Generator,
               window: int = 64) -> list[list[tuple[int, int]]]:
    """Shuffle the examples, sort each window of ``window`` by length (less padding), pack, shuffle the
    batches."""
    order = [ranges[i] for i in rng.permutation(len(ranges))]
    sorted_ = []
    for i in range(0, len(order), window):
        sorted_.extend(sorted(order[i : i + window], key=lambda r: r[1] - r[0]))
    groups = pack_examples(sorted_, batch_tokens)
    return [groups[i] for i in rng.permutation(len(groups))]


def make_batch(
    arrays: dict, group: list[tuple[int, int]], remap: np.ndarray | None = None
) -> dict[str, mx.array]:
    """Right-padded tokens [B, T], the loss rows [P] and their soft labels for one group of examples.

    A row t of an example is a loss position when token t + 1 is an answer token (its soft labels
    are then finite); labels beyond an example's cut are still the target's (they need no input).
    With ``remap`` ([V] int32: id → index in the training vocabulary, -1 outside it) the ids become
    indices, labels outside are dropped, and ``target_probs`` is renormalised over the rest.
    """
    T = max(hi - lo for lo, hi in group)
    tokens = np.zeros((len(group), T), dtype=np.int32)
    rows = []
    n = len(arrays["mask"])
    for b, (lo, hi) in enumerate(group):
        tokens[b, : hi - lo] = arrays["tokens"][lo:hi]
        end = int(arrays["offsets"][np.searchsorted(arrays["offsets"], lo, side="right")])
        t = np.arange(lo, hi)
        ok = (t + 1 < end) & arrays["mask"][np.minimum(t + 1, n - 1)]
        ok &= np.isfinite(arrays["topk_logprobs"][t, 0])
        rows.append(np.stack([t[ok], b * T + (t[ok] - lo)]))
    rows = np.concatenate(rows, axis=1)
    logp = arrays["topk_logprobs"][rows[0]].astype(np.float32)  # [P, K]
    raw = np.exp(logp)
    ids = arrays["topk_ids"][rows[0]].astype(np.int32)
    kept = raw
    if remap is not None:
        ids = remap[ids]
        kept = np.where(ids >= 0, raw, 0.0)
        ids = np.maximum(ids, 0)
    total = kept.sum(axis=-1, keepdims=True)
    return {
        "tokens": mx.array(tokens),
        "rows": mx.array(rows[1].astype(np.int32)),
        "topk_ids": mx.array(ids),
        "target_raw_probs": mx.array(raw),
        "target_probs": mx.array(kept / np.maximum(total, 1e-30)),
        "weights": mx.array((total[:, 0] > 0).astype(np.float32)),
    }


def training_vocab(cache: FeatureCache, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` token ids that appear most often among the soft labels of ``cache``, sorted, [C] int32."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for c in range(cache.num_chunks):
        arrays = load_corpus_chunk(cache, c)
        ok = np.isfinite(arrays["topk_logprobs"].astype(np.float32))
        counts += np.bincount(arrays["topk_ids"][ok], minlength=vocab_size)[:vocab_size]
    return np.sort(np.argsort(-counts, kind="stable")[: min(size, vocab_size)]).astype(np.int32)


def split_heldout(
    cache: FeatureCache, heldout_examples: int, max_seq_length: int
) -> dict[int, list[tuple[int, int]]]:
    """The last ``heldout_examples`` examples of the corpus (by chunk, ranges as ``example_ranges``)."""
    out: dict[int, list[tuple[int, int]]] = {}
    left = heldout_examples
    for c in range(cache.num_chunks - 1, -1, -1):
        if left <= 0:
            break
        ranges = example_ranges(load_corpus_chunk(cache, c), max_seq_length)
        take = ranges[max(0, len(ranges) - left) :]
        out[c] = take
        left -= len(take)
    return out


def _train_ranges(arrays: dict, c: int, config: DraftTrainConfig, held: dict) -> list[tuple[int, int]]:
    excluded = set(held.get(c, []))
    return [r for r in example_ranges(arrays, config.max_seq_length) if r not in excluded]


def steps_per_epoch(
    cache: FeatureCache, config: DraftTrainConfig, held: dict | None = None, epoch: int = 0
) -> int:
    """Batches in epoch ``epoch`` over ``cache`` (minus held-out examples); reads only the small arrays.

    The count can differ a little between epochs: each epoch packs a new shuffle of the examples.
    """
    held = held or {}
    steps = 0
    for c in range(cache.num_chunks):
        steps += len(_chunk_plan(cache.load_arrays(c, ("mask", "offsets")), c, config, held, epoch))
    return steps


def _chunk_plan(arrays: dict, c: int, config: DraftTrainConfig, held: dict, epoch: int):
    rng = np.random.default_rng([config.seed, epoch, c])
    return plan_epoch(_train_ranges(arrays, c, config, held), config.batch_tokens, rng)


def epoch_batches(cache: FeatureCache, config: DraftTrainConfig, held: dict, epoch: int):
    """(arrays, group) in the seeded order of ``epoch``: chunks permuted, then batches inside a chunk."""
    order = np.random.default_rng([config.seed, epoch]).permutation(cache.num_chunks)
    for c in order:
        arrays = load_corpus_chunk(cache, int(c))
        for group in _chunk_plan(arrays, int(c), config, held, epoch):
            yield arrays, group


