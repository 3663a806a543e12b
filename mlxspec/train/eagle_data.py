"""EAGLE training's settings and data: the config, the held-out record, the corpus checks, the draft
vocabulary and the batches of whole sequences (``mlxspec.train.eagle`` trains on them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .features import FeatureCache, check_corpus_arrays, chunk_batches, chunk_spans
from .loop import EvalRecord, TrainConfig


VERSIONS = (1, 3)
#: Settings that must match to resume a run (with the loop's own).
RESUME_KEYS = ("version", "draft_vocab_size", "ttt_steps", "batch_tokens", "max_seq_length", "max_steps")
#: Length buckets (tokens) used to group examples of similar length into a batch.
LENGTH_BUCKET = 16


@dataclass(frozen=True)
class EagleTrainConfig(TrainConfig):
    """Settings of an EAGLE head run: the loop's (``TrainConfig``) and these.

    Attributes:
        version: 1 (EAGLE-1: final-norm feature, target LM head) or 3 (EAGLE-3: three layers,
            reduced vocabulary, training-time test).
        draft_vocab_size: Draft vocabulary of an EAGLE-3 head (0: the whole target vocabulary).
        ttt_steps: Unrolled steps of the training-time test (EAGLE-3 loss; EAGLE-1 trains step 0
            only). Held-out agreement is reported for ``max(ttt_steps, eval_steps)`` steps.
        eval_steps: Unrolled steps scored on the held-out examples.
        step_decay: Weight of step k is ``step_decay ** k`` (EAGLE-3 uses 0.8).
        ce_weight: Weight of the soft cross-entropy next to the feature regression (EAGLE-1: 0.1).
        noise: Scale of EAGLE-1's uniform feature noise (0.2 in the reference; 0 disables).
        batch_tokens: Padded tokens per batch (examples x longest example).
        max_seq_length: Examples are cut to this many tokens.
        learning_rate: Peak AdamW learning rate.
        grad_clip: Clip the gradient to this global norm (0: no clipping).
        betas: AdamW's moment decay rates (0.9, 0.95 as in the reference trainer).
    """

    version: int = 3
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    eval_steps: int = 3
    step_decay: float = 0.8
    ce_weight: float = 0.1
    noise: float = 0.2
    batch_tokens: int = 4096
    max_seq_length: int = 1024
    learning_rate: float = 5e-4
    grad_clip: float = 0.5
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self):
        super().__post_init__()
        if self.version not in VERSIONS:
            raise ValueError(f"version must be 1 or 3, got {self.version}")
        for name in ("ttt_steps", "eval_steps", "batch_tokens", "max_seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_length < 3:
            raise ValueError(f"max-seq-length must be >= 3, got {self.max_seq_length}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft-vocab-size must be >= 0, got {self.draft_vocab_size}")

    @property
    def train_steps(self) -> int:
        """Unrolled steps in the loss: ``ttt_steps`` for EAGLE-3, 1 for EAGLE-1."""
        return self.ttt_steps if self.version == 3 else 1

    @property
    def unroll(self) -> int:
        """Steps the batches carry labels for (training and evaluation)."""
        return max(self.train_steps, self.eval_steps)


@dataclass(frozen=True)
class EagleEvalRecord(EvalRecord):
    """Held-out agreement with the target after ``epoch`` epochs (0 = before training).

    Attributes:
        acceptance: Per unrolled step k (1-based in words, index k - 1): top-1 agreement of the
            head's token with the target's greedy token, given the true earlier tokens and the
            head's own features from earlier steps (what greedy verification of a chain accepts
            at depth k when depths < k were accepted), [S].
        chain_acceptance: Fraction of positions whose first k drafts all agree, [S].
        tau: Estimated acceptance length of a greedy chain of depth S, 1 + Σ_k chain_acceptance[k]
            (counted where all S steps have a target).
        positions: Held-out step-1 positions scored.
    """

    acceptance: list[float]
    chain_acceptance: list[float]
    tau: float
    positions: int


# --- the corpus: examples, held-out split, draft vocabulary ---------------------------------


def check_corpus(cache: FeatureCache, version: int, target: nn.Module | None = None) -> None:
    """Refuse a corpus that cannot train this head (one line naming the fix).

    Raises:
        ValueError: the corpus was made by another model than ``target``; it has no
            ``topk_ids``/``topk_logprobs`` (a Medusa feature cache rather than a
            self-distillation corpus), or no ``aux`` features for EAGLE-3.
    """
    need = {"tokens", "mask", "offsets", "greedy", "hidden", "topk_ids", "topk_logprobs"} | (
        {"aux"} if version == 3 else set())
    check_corpus_arrays(cache, target, need, "EAGLE")


def token_counts(cache: FeatureCache, vocab_size: int) -> np.ndarray:
    """How often each id occurs as an assistant token of ``cache``, [V] int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for c in range(cache.num_chunks):
        a = cache.load_arrays(c, ("tokens", "mask", "offsets"))
        ids = a["tokens"][a["mask"]]
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def draft_vocabulary(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``size`` most frequent ids, as EAGLE-3's d2t offsets and t2d mask (docs/heads.md 5.4).

    Ties (and ids never seen, used when fewer than ``size`` ids occur) go to the smaller id.
    The chosen ids sorted ascending are u_0 < u_1 < ...; draft id j stands for target id
    ``j + d2t[j]``.

    Args:
        counts: Frequency of each target id, [V].
        size: Draft vocabulary size, 1 <= size <= V.

    Returns:
        tuple: ``d2t`` [size] int64 offsets (target = j + d2t[j]) and ``t2d`` [V] bool.

    Raises:
        ValueError: if ``size`` is not in [1, V].
    """
    vocab = len(counts)
    if not 1 <= size <= vocab:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab}], got {size}")
    order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, then smaller id
    chosen = np.sort(order[:size])
    t2d = np.zeros(vocab, dtype=bool)
    t2d[chosen] = True
    return (chosen - np.arange(size)).astype(np.int64), t2d


def target_to_draft(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """Index of each target id in the draft vocabulary (-1 when absent), [V] int32."""
    out = np.full(vocab_size, -1, dtype=np.int32)
    out[np.arange(len(d2t)) + d2t] = np.arange(len(d2t), dtype=np.int32)
    return out


# --- batches of sequences ----------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceBatch:
    """Whole examples, right-padded, with labels for ``S`` unrolled steps.

    Draft position j of row b reads feature j and token j + 1 of its example (step 0); step k
    reads token j + 1 + k and is scored on token j + 2 + k. Padding comes after each example,
    so causal attention never reads it.

    Attributes:
        features: Step-0 features, [B, T, F] float32: f_j (EAGLE-1, F = H) or the three target
            layers concatenated low, mid, high (EAGLE-3, F = 3H).
        tokens: Input tokens, [B, T + S - 1] int32: column j is token j + 1.
        next_features: f_{j+1}, [B, T, H] float32 (EAGLE-1 regression target), else ``None``.
        rows: Per step k, the flat indices into [B * T] of the loss positions, [n_k] int32.
        label_ids: Per step k, the soft labels' columns, [n_k, K] int32: draft ids (EAGLE-3) or
            indices into ``union_ids`` (EAGLE-1).
        label_probs: Per step k, their probabilities, [n_k, K] float32 (rows sum to 1).
        union_ids: EAGLE-1 only: the target ids of the soft-label columns, [U] int32.
        eval_rows: Per step k, flat indices of every assistant position, [m_k] int32.
        eval_greedy: Per step k, the target's greedy token there, [m_k] int32 (target ids).
        tokens_padded: B * T.
    """

    features: mx.array
    tokens: mx.array
    next_features: mx.array | None
    rows: list[mx.array]
    label_ids: list[mx.array]
    label_probs: list[mx.array]
    union_ids: mx.array | None
    eval_rows: list[np.ndarray]
    eval_greedy: list[np.ndarray]
    tokens_padded: int

    @property
    def positions(self) -> int:
        return int(self.rows[0].shape[0])


def _group(spans: list[tuple[int, int]], batch_tokens: int, rng: np.random.Generator | None):
    """Batches of similar-length spans with at most ``batch_tokens`` padded tokens each."""
    if rng is None:  # in corpus order
        order = range(len(spans))
    else:  # similar lengths together (less padding), random within a length bucket
        order = sorted(rng.permutation(len(spans)), key=lambda i: spans[i][1] // LENGTH_BUCKET)
    batches, current, longest = [], [], 0
    for i in order:
        length = spans[i][1] - 1  # draft positions
        if current and (len(current) + 1) * max(longest, length) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(spans[i])
        longest = max(longest, length)
    if current:
        batches.append(current)
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def plan_epoch(cache: FeatureCache, config: EagleTrainConfig, *, epoch: int = 0,
               shuffle: bool = True) -> list[tuple[int, list[tuple[int, int]]]]:
    """The batches of one epoch as ``(chunk, [(start, length), ...])``, in order.

    With ``shuffle`` the chunk order, the examples and the batch order are permuted by
    generators seeded with (seed, epoch[, chunk]), so the same arguments always give the same
    batches (what resuming relies on); batches group examples of similar length. Without it,
    examples come in corpus order.
    """
    plan = []
    for c, spans in chunk_spans(cache, config.max_seq_length, seed=config.seed, epoch=epoch, shuffle=shuffle):
        rng = np.random.default_rng([config.seed, epoch, c]) if shuffle else None
        plan.extend((c, batch) for batch in _group(spans, config.batch_tokens, rng))
    return plan


def _soft_labels(ids: np.ndarray, logprobs: np.ndarray, to_draft: np.ndarray | None):
    """Top-K log-probs → renormalised probabilities, optionally restricted to the draft vocabulary."""
    probs = np.exp(logprobs.astype(np.float32))  # -inf rows → 0
    if to_draft is not None:
        ids = to_draft[ids]
        probs = np.where(ids >= 0, probs, 0.0)
        ids = np.maximum(ids, 0)
    total = probs.sum(-1, keepdims=True)
    return ids.astype(np.int32), (probs / np.maximum(total, 1e-30)).astype(np.float32), total[..., 0] > 0


def make_batch(arrays: dict, spans: list[tuple[int, int]], config: EagleTrainConfig,
               to_draft: np.ndarray | None) -> SequenceBatch:
    """Materialise one batch from a loaded chunk (see ``SequenceBatch`` for the layout).

    Args:
        arrays: ``FeatureCache.load_chunk`` output.
        spans: ``(start, length)`` of each example in the chunk.
        config: The run's settings (version, unrolled steps).
        to_draft: EAGLE-3: ``target_to_draft(d2t, V)``; ``None`` for EAGLE-1 or a full draft vocabulary.
    """
    S, B = config.unroll, len(spans)
    T = max(length for _, length in spans) - 1
    W = T + S - 1
    aux = config.version == 3
    width = arrays["aux"].shape[1] * arrays["aux"].shape[2] if aux else arrays["hidden"].shape[1]
    K = arrays["topk_ids"].shape[1]
    features = np.zeros((B, T, width), np.float32)
    next_features = np.zeros((B, T, arrays["hidden"].shape[1]), np.float32) if not aux else None
    tokens = np.zeros((B, W), np.int32)
    ids, logprobs = np.zeros((B, W, K), np.int32), np.full((B, W, K), -np.inf, np.float16)
    valid, greedy = np.zeros((B, W), bool), np.full((B, W), -1, np.int32)
    for b, (s, length) in enumerate(spans):
        n = length - 1
        src = arrays["aux"][s : s + n].reshape(n, -1) if aux else arrays["hidden"][s : s + n]
        features[b, :n] = src
        if next_features is not None:
            next_features[b, :n] = arrays["hidden"][s + 1 : s + length]
        tokens[b, :n] = arrays["tokens"][s + 1 : s + length]
        ids[b, :n], logprobs[b, :n] = (
            arrays["topk_ids"][s + 1 : s + length],
            arrays["topk_logprobs"][s + 1 : s + length],
        )
        valid[b, : n - 1] = arrays["mask"][s + 2 : s + length]
        greedy[b, :n] = arrays["greedy"][s + 1 : s + length]
    valid &= greedy >= 0
    union = None
    if aux:
        ids, probs, ok = _soft_labels(ids, logprobs, to_draft)
        loss_valid = valid & ok & (to_draft[np.maximum(greedy, 0)] >= 0 if to_draft is not None else True)
    else:
        ids, probs, ok = _soft_labels(ids, logprobs, None)
        loss_valid = valid & ok
        union = np.unique(ids[loss_valid])
        ids = np.searchsorted(union, ids).clip(0, max(len(union) - 1, 0)).astype(np.int32)
    grid = np.arange(B * T).reshape(B, T)
    rows, label_ids, label_probs, eval_rows, eval_greedy = [], [], [], [], []
    for k in range(S):
        window = (slice(None), slice(k, k + T))
        sel = loss_valid[window]
        rows.append(mx.array(grid[sel].astype(np.int32)))
        label_ids.append(mx.array(ids[window][sel]))
        label_probs.append(mx.array(probs[window][sel]))
        sel = valid[window]
        eval_rows.append(grid[sel])
        eval_greedy.append(greedy[window][sel])
    return SequenceBatch(mx.array(features), mx.array(tokens),
                         mx.array(next_features) if next_features is not None else None, rows, label_ids,
                         label_probs, mx.array(union.astype(np.int32)) if union is not None else None,
                         eval_rows, eval_greedy, B * T)


def sequence_batches(cache: FeatureCache, plan, config: EagleTrainConfig, to_draft: np.ndarray | None, *,
                     start: int = 0) -> Iterator[SequenceBatch]:
    """Materialise ``plan[start:]``, loading each chunk once (one chunk in memory at a time)."""
    return chunk_batches(
        cache, plan[start:], lambda arrays, c, spans: make_batch(arrays, spans, config, to_draft)
    )
