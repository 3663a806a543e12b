"""EAGLE-1 and EAGLE-3 head training on a self-distillation corpus of the frozen target.

The corpus (``mlxspec.train.corpus``, read through ``FeatureCache``) holds, per token t of each
example: the token, whether it is an assistant token, the target's final-norm feature f_t, the
residual stream entering three target layers (EAGLE-3's low/middle/high features), the target's
greedy next token and its top-K log-softmax (the distribution of token t + 1). The head sees
whole examples, attends causally over them like the target, and is scored only where the token
it predicts is an assistant token. Draft position j pairs the feature of token j with token
j + 1 and predicts token j + 2 (heads.md 4.1).

- **EAGLE-1** (Li et al. 2024, arXiv 2401.15077, section 4; heads.md 4.7): predict f_{j+1} from
  fc(concat(emb(x_{j+1}), f_j + noise)); loss = SmoothL1(f̂_{j+1}, f_{j+1}) + 0.1 · soft CE of the
  target's LM head on f̂_{j+1} against the target's distribution. Two approximations keep the
  49152-wide LM head affordable on a CPU, both exact in the limit K → V: the target's
  distribution is its stored top-K renormalised (K = 32 holds nearly all the mass of a greedy
  self-distilled answer), and the head's softmax runs over the union of the batch's top-K ids
  instead of the whole vocabulary (a sampled softmax whose negatives are the other positions'
  likely tokens). Feature noise U(-0.5, 0.5) · 0.2 · 512 / T as in the reference trainer.
- **EAGLE-3** (Li et al. 2025, arXiv 2503.01840, section 3; heads.md 5.6): training-time test.
  Step 0 reads fc(low, mid, high); step k > 0 reads the head's own step k - 1 output at the same
  position and the next token, attends to the step-0 keys of positions <= j plus its own
  keys from steps 1..k at position j (RoPE position j + k), exactly what a chain draft sees at
  inference. Loss Σ_k 0.8^k · soft CE over the reduced draft vocabulary against the target's
  top-K restricted to it and renormalised, on positions whose target argmax is drafteable.
  The draft vocabulary is the ``draft_vocab_size`` most frequent assistant tokens of the
  training examples (``draft_vocabulary``: d2t as offsets, t2d as a mask; heads.md 5.4).

``train_eagle`` is a generator of records, like ``train_medusa``: an ``EagleStepRecord`` per
batch and an ``EagleEvalRecord`` (held-out top-1 agreement with the target's greedy token per
unrolled step and the chain acceptance it implies) before training and after every epoch. It
checkpoints into its output folder (``save_eagle`` layout, optimizer state and
``trainer_state.json``) after every epoch and every ``save_every`` steps, and resumes there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..heads.eagle import EagleConfig, EagleHead, load_eagle, save_eagle
from ..taps import logits_width, model_body, output_head
from .features import FeatureCache, model_fingerprint, write_json
from .medusa import warmup_cosine

STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
VERSIONS = (1, 3)
#: Settings that must match to resume a run.
RESUME_KEYS = ("version", "draft_vocab_size", "ttt_steps", "batch_tokens", "max_seq_length", "seed", "max_steps")
#: Length buckets (tokens) used to group examples of similar length into a batch.
LENGTH_BUCKET = 16


@dataclass(frozen=True)
class EagleTrainConfig:
    """Settings of an EAGLE head run.

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
        epochs: Passes over the training examples.
        max_steps: Stop after this many optimiser steps in all (the last epoch ends early, is
            scored and saved as usual; the learning-rate schedule spans these steps); 0 = no cap.
        batch_tokens: Padded tokens per batch (examples x longest example).
        max_seq_length: Examples are cut to this many tokens.
        learning_rate: Peak AdamW learning rate.
        warmup_steps: Linear warm-up steps before the cosine decay to 0.
        weight_decay: AdamW weight decay.
        grad_clip: Clip the gradient to this global norm (0: no clipping).
        seed: Seed of the initial weights and the batch order.
        save_every: Also checkpoint every this many steps (0: only after each epoch).
        max_eval_positions: Held-out positions scored per evaluation (about).
        save_dtype: dtype of the per-epoch copies in ``epoch-<n>/`` (the resume checkpoint is float32).
    """

    version: int = 3
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    eval_steps: int = 3
    step_decay: float = 0.8
    ce_weight: float = 0.1
    noise: float = 0.2
    epochs: int = 1
    max_steps: int = 0
    batch_tokens: int = 4096
    max_seq_length: int = 1024
    learning_rate: float = 5e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    save_every: int = 0
    max_eval_positions: int = 4096
    save_dtype: str = "float16"

    def __post_init__(self):
        if self.version not in VERSIONS:
            raise ValueError(f"version must be 1 or 3, got {self.version}")
        for name in ("ttt_steps", "eval_steps", "epochs", "batch_tokens", "max_seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_length < 3:
            raise ValueError(f"max-seq-length must be >= 3, got {self.max_seq_length}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning-rate must be > 0, got {self.learning_rate}")
        if self.max_steps < 0:
            raise ValueError(f"max-steps must be >= 0, got {self.max_steps}")
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
class EagleStepRecord:
    """One optimiser step.

    Attributes:
        epoch: Epoch index, from 0.
        step: Steps done in this epoch (1-based).
        steps_per_epoch: Steps in this epoch.
        loss: Total loss (nats; EAGLE-1 adds the feature regression).
        step_losses: Soft cross-entropy per unrolled step (nats), [S].
        regression: EAGLE-1's SmoothL1 feature loss (``None`` for EAGLE-3).
        positions: Loss positions at step 0.
        tokens: Padded tokens in the batch.
        step_s: Wall time of the step, seconds.
    """

    epoch: int
    step: int
    steps_per_epoch: int
    loss: float
    step_losses: list[float]
    regression: float | None
    positions: int
    tokens: int
    step_s: float


@dataclass(frozen=True)
class EagleEvalRecord:
    """Held-out agreement with the target after ``epoch`` epochs (0 = before training).

    Attributes:
        epoch: Epochs finished.
        acceptance: Per unrolled step k (1-based in words, index k - 1): top-1 agreement of the
            head's token with the target's greedy token, given the true earlier tokens and the
            head's own features from earlier steps (what greedy verification of a chain accepts
            at depth k when depths < k were accepted), [S].
        chain_acceptance: Fraction of positions whose first k drafts all agree, [S].
        tau: Estimated acceptance length of a greedy chain of depth S, 1 + Σ_k chain_acceptance[k]
            (counted where all S steps have a target).
        positions: Held-out step-1 positions scored.
        train_loss: Mean training loss over the epoch (``None`` before training).
        checkpoint: Folder of this epoch's head (``None`` before training).
    """

    epoch: int
    acceptance: list[float]
    chain_acceptance: list[float]
    tau: float
    positions: int
    train_loss: float | None = None
    checkpoint: str | None = None


@dataclass
class _State:
    config: dict
    corpus: str
    epoch: int = 0
    step: int = 0
    global_step: int = 0
    history: list[dict] = field(default_factory=list)


# --- the corpus: examples, held-out split, draft vocabulary ---------------------------------


def _small(cache: FeatureCache, c: int, names=("tokens", "mask", "offsets")) -> dict[str, np.ndarray]:
    """Only the small arrays of chunk ``c`` (npz members load on access)."""
    with np.load(cache.directory / cache.manifest["chunks"][c]["file"]) as data:
        return {k: data[k] for k in names}


def check_corpus(cache: FeatureCache, version: int, target: nn.Module | None = None) -> None:
    """Refuse a corpus that cannot train this head (one line naming the fix).

    Raises:
        ValueError: the corpus was made by another model than ``target``; it has no
            ``topk_ids``/``topk_logprobs`` (a Medusa feature cache rather than a
            self-distillation corpus), or no ``aux`` features for EAGLE-3.
    """
    if target is not None and cache.manifest.get("model") not in (None, model_fingerprint(target)):
        raise ValueError(f"the corpus in {cache.directory} was made by another model than this target; "
                         "build one with this target (mlxspec train corpus --model ...)")
    with np.load(cache.directory / cache.manifest["chunks"][0]["file"]) as data:
        names = set(data.files)
    need = {"tokens", "mask", "offsets", "greedy", "hidden", "topk_ids", "topk_logprobs"} | (
        {"aux"} if version == 3 else set())
    missing = sorted(need - names)
    if missing:
        raise ValueError(f"{cache.directory} lacks {', '.join(missing)}: EAGLE training needs a self-distillation "
                         "corpus (mlxspec.train.corpus), not a Medusa feature cache")


def token_counts(cache: FeatureCache, vocab_size: int) -> np.ndarray:
    """How often each id occurs as an assistant token of ``cache``, [V] int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for c in range(cache.num_chunks):
        a = _small(cache, c)
        ids = a["tokens"][a["mask"]]
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def draft_vocabulary(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``size`` most frequent ids, as EAGLE-3's d2t offsets and t2d mask (heads.md 5.4).

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


def _spans(arrays: dict, max_len: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each example (cut to ``max_len``) that predicts an assistant token."""
    offsets, mask = arrays["offsets"], arrays["mask"]
    out = []
    for e in range(len(offsets) - 1):
        start, length = int(offsets[e]), int(min(offsets[e + 1] - offsets[e], max_len))
        if length >= 3 and mask[start + 2 : start + length].any():
            out.append((start, length))
    return out


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
    order = np.arange(cache.num_chunks)
    if shuffle:
        order = np.random.default_rng([config.seed, epoch]).permutation(cache.num_chunks)
    plan = []
    for c in map(int, order):
        spans = _spans(_small(cache, c), config.max_seq_length)
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
        ids[b, :n], logprobs[b, :n] = arrays["topk_ids"][s + 1 : s + length], arrays["topk_logprobs"][s + 1 : s + length]
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
    loaded, arrays = None, None
    for c, spans in plan[start:]:
        if c != loaded:
            arrays = None  # drop the previous chunk before reading the next
            arrays, loaded = cache.load_chunk(c), c
        yield make_batch(arrays, spans, config, to_draft)


# --- the unrolled forward (training-time test) -------------------------------------------------


class _TTTAttention(nn.Module):
    """The head's attention at unrolled step k (heads.md 5.6): queries at position j (RoPE j + k)
    see the step-0 keys of positions <= j and the step-1..k keys of position j itself.

    Wraps the head's own mlx-lm ``Attention`` (its projections, RoPE and scale); ``memory``
    carries the step-0 keys/values and the diagonal ones across steps.
    """

    def __init__(self, inner: nn.Module, memory: dict, step: int):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_memory", memory)
        object.__setattr__(self, "_step", step)

    def __call__(self, z: mx.array, mask=None, cache=None) -> mx.array:
        a, m, k = self.inner, self._memory, self._step
        B, T, _ = z.shape
        q = a.q_proj(z).reshape(B, T, a.n_heads, -1).transpose(0, 2, 1, 3)  # [B, nh, T, hd]
        keys = a.k_proj(z).reshape(B, T, a.n_kv_heads, -1).transpose(0, 2, 1, 3)  # [B, nkv, T, hd]
        values = a.v_proj(z).reshape(B, T, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, keys = a.rope(q, offset=k), a.rope(keys, offset=k)
        if k == 0:
            m.update(keys=keys, values=values, diag_keys=[], diag_values=[])
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=a.scale, mask="causal")
        else:
            m["diag_keys"].append(keys)
            m["diag_values"].append(values)
            out = _unrolled_attention(q * a.scale, m)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


def _unrolled_attention(q: mx.array, m: dict) -> mx.array:
    """softmax over [causal step-0 scores | diagonal scores of steps 1..k] (q pre-scaled)."""
    B, nh, T, hd = q.shape
    nkv = m["keys"].shape[1]
    qg = q.reshape(B, nkv, nh // nkv, T, hd)  # GQA: query heads grouped by their kv head
    scores = qg @ m["keys"][:, :, None].swapaxes(-1, -2)  # [B, nkv, r, T, T]
    causal = mx.arange(T)[:, None] >= mx.arange(T)[None]
    scores = mx.where(causal, scores, mx.array(-mx.inf, scores.dtype))
    diag_k = mx.stack(m["diag_keys"], axis=-2)[:, :, None]  # [B, nkv, 1, T, k, hd]
    diag = (qg[..., None, :] * diag_k).sum(-1)  # [B, nkv, r, T, k]
    weights = mx.softmax(mx.concatenate([scores, diag], axis=-1), axis=-1, precise=True)
    diag_v = mx.stack(m["diag_values"], axis=-2)[:, :, None]  # [B, nkv, 1, T, k, hd]
    out = weights[..., :T] @ m["values"][:, :, None] + (weights[..., T:, None] * diag_v).sum(-2)
    return out.reshape(B, nh, T, hd)


def _attention_owner(head) -> nn.Module:
    return head.layers[0] if head.config.version == 1 else head.midlayer


def unroll(head, embed, features: mx.array, tokens: mx.array, steps: int,
           noise: mx.array | None = None) -> list[mx.array]:
    """The head's outputs at ``steps`` unrolled steps over whole sequences (training-time test).

    Li et al. 2025 (EAGLE-3, arXiv 2503.01840) section 3.3; heads.md 5.6. Step 0 is the head's
    ordinary causal forward over (features, tokens[:, :T]); step k > 0 reads the step k - 1
    outputs as features and tokens[:, k : k + T], and position j attends to the step-0 keys of
    positions <= j plus its own keys from steps 1..k (what a chain draft at depth k sees).

    Args:
        head: An ``EagleHead``.
        embed: The target's token embedding.
        features: Step-0 features, [B, T, F] float32.
        tokens: [B, T + steps - 1] int32; column j is the token after feature j.
        steps: Unrolled steps S >= 1.
        noise: Added to the step-0 features (EAGLE-1's input noise), [B, T, F], or ``None``.

    Returns:
        list[mx.array]: S arrays [B, T, H]: the predicted next features at each step.
    """
    T = features.shape[1]
    owner = _attention_owner(head)
    inner, memory, outs = owner.self_attn, {}, []
    h = features if noise is None else features + noise
    try:
        for k in range(steps):
            owner.self_attn = _TTTAttention(inner, memory, k)
            h = head(h, tokens[:, k : k + T], embed)
            outs.append(h)
    finally:
        owner.self_attn = inner
    return outs


# --- losses ---------------------------------------------------------------------------------


def _soft_ce(logits: mx.array, ids: mx.array, probs: mx.array) -> mx.array:
    """Σ over rows of -Σ_k p_k log softmax(logits)[ids_k]: logits [n, C], ids/probs [n, K]."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(probs * mx.take_along_axis(logprobs, ids, axis=-1)).sum()


def eagle3_loss(head, batch: SequenceBatch, embed, config: EagleTrainConfig) -> tuple[mx.array, mx.array]:
    """EAGLE-3 training-time-test loss Σ_k decay^k · CE_k (heads.md 5.6).

    CE_k is the mean soft cross-entropy of the head's draft-vocabulary log-softmax at step k
    against the target's top-K distribution restricted to the draft vocabulary and renormalised,
    over positions whose target argmax is in the draft vocabulary.

    Args:
        head: An EAGLE-3 ``EagleHead``.
        batch: A ``SequenceBatch`` with at least ``config.ttt_steps`` steps of labels.
        embed: The target's token embedding.
        config: Steps and their decay.

    Returns:
        tuple: total loss (scalar) and the per-step cross-entropies [S] (nats).
    """
    outs = unroll(head, embed, batch.features, batch.tokens, config.train_steps)
    per_step = []
    for k, x in enumerate(outs):
        rows = x.reshape(-1, x.shape[-1])[batch.rows[k]]  # [n_k, H]
        ce = _soft_ce(head.logits(rows), batch.label_ids[k], batch.label_probs[k])
        per_step.append(ce / max(int(batch.rows[k].shape[0]), 1))
    per_step = mx.stack(per_step)
    weights = mx.array([config.step_decay**k for k in range(len(outs))])
    return (weights * per_step).sum(), per_step


def eagle1_loss(head, batch: SequenceBatch, embed, lm_weight: mx.array, config: EagleTrainConfig,
                noise: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """EAGLE-1 loss: SmoothL1(f̂_{j+1}, f_{j+1}) + ``ce_weight`` · soft CE (heads.md 4.7).

    The regression is averaged over the hidden size and the loss positions. The soft CE scores
    the target's LM head on f̂_{j+1} over ``batch.union_ids`` (the union of the batch's top-K
    ids: a sampled softmax) against the target's top-K probabilities renormalised.

    Args:
        head: An EAGLE-1 ``EagleHead``.
        batch: A ``SequenceBatch`` with ``next_features`` and ``union_ids``.
        embed: The target's token embedding.
        lm_weight: The target's LM head as a matrix, [V, H] float32.
        config: ``ce_weight``.
        noise: Input-feature noise, [B, T, H], or ``None``.

    Returns:
        tuple: total loss, the soft CE [1] and the regression loss (scalars, nats).
    """
    x = unroll(head, embed, batch.features, batch.tokens, 1, noise)[0]
    H, n = x.shape[-1], max(int(batch.rows[0].shape[0]), 1)
    rows = x.reshape(-1, H)[batch.rows[0]]  # [n, H]
    true = batch.next_features.reshape(-1, H)[batch.rows[0]]
    regression = nn.losses.smooth_l1_loss(rows, true, reduction="none").mean(-1).sum() / n
    logits = rows @ lm_weight[batch.union_ids].T  # [n, U]
    ce = _soft_ce(logits, batch.label_ids[0], batch.label_probs[0]) / n
    return regression + config.ce_weight * ce, ce[None], regression


def feature_noise(shape: tuple[int, ...], scale: float, key: mx.array) -> mx.array:
    """EAGLE-1's input noise U(-0.5, 0.5) · scale · 512 / T for features of shape [B, T, F]."""
    return (mx.random.uniform(shape=shape, key=key) - 0.5) * (scale * 512 / shape[1])


# --- held-out agreement -------------------------------------------------------------------------


def _greedy_ids(head, rows: mx.array, lm_weight: mx.array | None, block: int = 512) -> np.ndarray:
    """The head's top-1 target id for each row of draft hidden states [n, H]."""
    out = []
    for i in range(0, rows.shape[0], block):
        part = rows[i : i + block]
        logits = part @ lm_weight.T if head.config.version == 1 else head.logits(part)
        ids = head.target_ids(mx.argmax(logits, axis=-1)) if head.config.version == 3 else mx.argmax(logits, -1)
        out.append(np.array(ids.astype(mx.int32)))
    return np.concatenate(out) if out else np.zeros(0, np.int32)


def evaluate(head, embed, cache: FeatureCache, config: EagleTrainConfig, *, lm_weight: mx.array | None = None,
             to_draft: np.ndarray | None = None) -> EagleEvalRecord:
    """Held-out top-1 agreement with the target's greedy token per unrolled step (an acceptance estimate).

    Positions are every draft position whose predicted token is an assistant token, in corpus
    order, until about ``config.max_eval_positions`` step-1 positions are scored.

    Args:
        head: The head.
        embed: The target's token embedding.
        cache: Held-out corpus.
        config: ``eval_steps``, ``max_eval_positions``, batch shape.
        lm_weight: The target's LM head [V, H] (EAGLE-1).
        to_draft: ``target_to_draft`` of the head's vocabulary (EAGLE-3 with a reduced one).

    Returns:
        EagleEvalRecord: with ``epoch`` 0 (the caller sets it).
    """
    S = config.eval_steps
    agree = [[] for _ in range(S)]
    chains = []
    seen = 0
    for batch in sequence_batches(cache, plan_epoch(cache, config, shuffle=False), config, to_draft):
        if seen >= config.max_eval_positions:
            break
        outs = unroll(head, embed, batch.features, batch.tokens, S)
        grid = np.full((S, batch.tokens_padded), -1, np.int8)  # -1 = no target at this step
        for k, x in enumerate(outs):
            rows = batch.eval_rows[k]
            guess = _greedy_ids(head, x.reshape(-1, x.shape[-1])[mx.array(rows.astype(np.int32))], lm_weight)
            hit = guess == batch.eval_greedy[k]
            grid[k, rows] = hit
            agree[k].append(hit)
        full = (grid >= 0).all(axis=0)  # positions with a target at every step
        chains.append(np.cumprod(grid[:, full] == 1, axis=0))  # [S, n]: first k drafts all agree
        seen += len(batch.eval_rows[0])
    acceptance = [float(np.concatenate(a).mean()) if a and sum(map(len, a)) else 0.0 for a in agree]
    chain = np.concatenate(chains, axis=1) if chains else np.zeros((S, 0))
    chain_acceptance = chain.mean(axis=1).tolist() if chain.shape[1] else [0.0] * S
    return EagleEvalRecord(0, acceptance, chain_acceptance, 1.0 + sum(chain_acceptance), seen)


# --- the training loop --------------------------------------------------------------------------


def lm_head_matrix(target: nn.Module) -> mx.array:
    """The target's LM head as a [V, H] float32 matrix (tied, untied or quantized)."""
    H = int(target.args.hidden_size)
    return output_head(target)(mx.eye(H)).T.astype(mx.float32)


def init_head(target: nn.Module, config: EagleTrainConfig, *, aux_layers=None, d2t: np.ndarray | None = None,
              feature_rms: np.ndarray | None = None):
    """A fresh head shaped like one layer of ``target`` (heads.md 4.1 / 5.2).

    EAGLE-3 heads start with their LM head copied from the target's (the rows of the draft
    vocabulary). The residual streams they read are large in the middle and top layers (RMS ~70
    in SmolLM2 against ~3 in layer 2), and fc's output is the head's un-normed residual, so fc's
    columns for feature block b start divided by that block's RMS: the residual starts at the
    scale of the attention and MLP outputs that training has to grow.

    Args:
        target: The target (its hidden size, heads, MLP width, vocabulary, LM head).
        config: ``version`` and the draft vocabulary size.
        aux_layers: EAGLE-3: the target layers whose inputs are the features (the corpus's).
        d2t: EAGLE-3 reduced vocabulary offsets [V_draft] (``draft_vocabulary``), or ``None``.
        feature_rms: EAGLE-3: RMS of each feature block in the corpus, [3], or ``None``.
    """
    args = target.args
    vocab = int(logits_width(target))
    shape = EagleConfig(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or args.num_attention_heads,
        head_dim=getattr(args, "head_dim", None), vocab_size=vocab, version=config.version,
        rms_norm_eps=args.rms_norm_eps, draft_vocab_size=len(d2t) if d2t is not None else None,
        aux_layers=tuple(aux_layers) if config.version == 3 and aux_layers is not None else None)
    head = EagleHead(shape)
    if config.version == 3:
        ids = np.arange(shape.draft_vocab_size) + (d2t if d2t is not None else 0)
        head.lm_head.weight = lm_head_matrix(target)[mx.array(ids)]
        if feature_rms is not None:
            scale = np.repeat(1.0 / np.maximum(feature_rms, 1e-6), shape.target_hidden_size)  # [3 H_t]
            head.fc.weight = head.fc.weight * mx.array(scale.astype(np.float32))
        if shape.reduced_vocab:
            head.d2t = mx.array(d2t.astype(np.int32))
            head.t2d = mx.array(np.isin(np.arange(vocab), ids))
    mx.eval(head.parameters())
    return head


def feature_rms(cache: FeatureCache, max_positions: int = 4096) -> np.ndarray:
    """RMS of each EAGLE-3 feature block (``aux`` [N, 3, H]) over the first positions of chunk 0, [3]."""
    with np.load(cache.directory / cache.manifest["chunks"][0]["file"]) as data:
        aux = data["aux"][:max_positions].astype(np.float32)
    return np.sqrt((aux**2).mean(axis=(0, 2)))


def train_eagle(target: nn.Module, train: FeatureCache, heldout: FeatureCache | None, output: str | Path,
                config: EagleTrainConfig, *, resume: bool = True) -> Iterator[EagleStepRecord | EagleEvalRecord]:
    """Train an EAGLE-1 or EAGLE-3 head on a self-distillation corpus, checkpointing into ``output``.

    Args:
        target: The frozen target (float32): its embedding, LM head and shape.
        train: The training corpus (``mlxspec.train.corpus``).
        heldout: A held-out corpus for the per-epoch agreement, or ``None``.
        output: Checkpoint folder: ``config.json`` + ``model.safetensors`` (latest, float32,
            loadable by ``load_eagle``), ``optimizer.safetensors``, ``trainer_state.json``, and
            ``epoch-<n>/`` per epoch in ``save_dtype``.
        config: Settings.
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        ``EagleEvalRecord`` before training (fresh runs) and after each epoch; ``EagleStepRecord`` per step.

    Raises:
        ValueError: the corpus lacks what the version needs, ``output`` holds a run with other
            settings or data (when resuming), or ``resume`` is false and ``output`` holds a run.
    """
    check_corpus(train, config.version, target)
    if heldout is not None:
        check_corpus(heldout, config.version, target)
    output = Path(output)
    embed = model_body(target).embed_tokens
    lm_weight = lm_head_matrix(target) if config.version == 1 else None
    plans = _plans(train, config)
    state, head, optimizer = _start(target, train, output, config, resume, sum(map(len, plans)))
    to_draft = target_to_draft(np.array(head.d2t), head.config.vocab_size) if head.config.reduced_vocab else None
    score = lambda: evaluate(head, embed, heldout, config, lm_weight=lm_weight, to_draft=to_draft)  # noqa: E731
    if state.global_step == 0 and heldout is not None and not state.history:
        record = score()
        state.history.append(asdict(record))
        yield record
    step = _step_function(head, optimizer, embed, lm_weight, config)
    for epoch in range(state.epoch, config.epochs):
        losses, plan = [], plans[epoch]
        if not plan:  # max_steps reached in an earlier epoch
            break
        for i, batch in enumerate(sequence_batches(train, plan, config, to_draft, start=state.step), state.step):
            t0 = time.perf_counter()
            key = mx.random.key(config.seed * 1_000_003 + state.global_step)
            loss, per_step, regression = step(batch, key)
            losses.append(loss)
            state.step, state.global_step = i + 1, state.global_step + 1
            if config.save_every and state.step % config.save_every == 0:
                _checkpoint(output, head, optimizer, state)
            yield EagleStepRecord(epoch, i + 1, len(plan), loss, per_step, regression, batch.positions,
                                  batch.tokens_padded, time.perf_counter() - t0)
        yield _end_epoch(epoch, losses, head, optimizer, heldout, output, config, state, score)


def _plans(train: FeatureCache, config: EagleTrainConfig) -> list[list]:
    """Each epoch's batches, cut so that there are at most ``max_steps`` in all."""
    plans, left = [], config.max_steps or None
    for epoch in range(config.epochs):
        plan = plan_epoch(train, config, epoch=epoch)
        plans.append(plan if left is None else plan[:left])
        left = None if left is None else left - len(plans[-1])
    return plans


def _step_function(head, optimizer, embed, lm_weight, config: EagleTrainConfig):
    """One AdamW step (clipped gradient) on a batch; returns (loss, per-step CE, regression) as floats."""
    if config.version == 3:
        loss_and_grad = nn.value_and_grad(head, lambda b: eagle3_loss(head, b, embed, config))
    else:
        loss_and_grad = nn.value_and_grad(
            head, lambda b, noise: eagle1_loss(head, b, embed, lm_weight, config, noise))

    def step(batch: SequenceBatch, key: mx.array):
        if config.version == 3:
            (loss, per_step), grads = loss_and_grad(batch)
            regression = None
        else:
            noise = feature_noise(batch.features.shape, config.noise, key) if config.noise > 0 else None
            (loss, per_step, regression), grads = loss_and_grad(batch, noise)
        if config.grad_clip > 0:
            grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        optimizer.update(head, grads)
        mx.eval(loss, per_step, regression, head.parameters(), optimizer.state)
        return loss.item(), per_step.tolist(), None if regression is None else regression.item()

    return step


def _end_epoch(epoch: int, losses: list[float], head, optimizer, heldout, output: Path,
               config: EagleTrainConfig, state: _State, score) -> EagleEvalRecord:
    """Save ``epoch-<n>/``, score the held-out corpus, checkpoint; the epoch's ``EagleEvalRecord``."""
    state.epoch, state.step = epoch + 1, 0
    folder = output / f"epoch-{epoch + 1}"
    _save_copy(folder, head, config.save_dtype)
    record = score() if heldout is not None else EagleEvalRecord(0, [], [], 0.0, 0)
    mean_loss = sum(losses) / len(losses) if losses else None
    record = EagleEvalRecord(epoch + 1, record.acceptance, record.chain_acceptance, record.tau, record.positions,
                             mean_loss, str(folder))
    state.history.append(asdict(record))
    _checkpoint(output, head, optimizer, state)
    return record


def _start(target, train: FeatureCache, output: Path, config: EagleTrainConfig, resume: bool, total_steps: int):
    """Fresh head and optimiser, or the ones checkpointed in ``output``."""
    schedule = warmup_cosine(config.learning_rate, config.warmup_steps, total_steps)
    optimizer = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95],
                            weight_decay=config.weight_decay)
    fresh = _State(asdict(config), str(train.directory.resolve()))
    path = output / STATE
    if not path.is_file():
        d2t = None
        vocab = int(logits_width(target))
        if config.version == 3 and 0 < config.draft_vocab_size < vocab:
            d2t, _ = draft_vocabulary(token_counts(train, vocab), config.draft_vocab_size)
        mx.random.seed(config.seed)  # the initial weights are a function of the settings, like the batches
        rms = feature_rms(train) if config.version == 3 else None
        head = init_head(target, config, aux_layers=train.manifest.get("aux_layers"), d2t=d2t, feature_rms=rms)
        optimizer.init(head.trainable_parameters())
        return fresh, head, optimizer
    if not resume:
        raise ValueError(f"{output} already holds a training run; resume it or pass a fresh --output")
    state = _State(**json.loads(path.read_text()))
    changed = [k for k in RESUME_KEYS if state.config.get(k) != fresh.config[k]]
    if changed or state.corpus != fresh.corpus:
        what = ", ".join(changed) or "the training corpus"
        raise ValueError(f"{output} holds a run with different {what}; use the same settings to resume, "
                         "or pass a fresh --output")
    state.config = fresh.config
    head = load_eagle(output, target=target, dtype=mx.float32)
    head.train()
    optimizer.init(head.trainable_parameters())
    optimizer.state = tree_unflatten(list(mx.load(str(output / OPTIMIZER)).items()))
    return state, head, optimizer


def _checkpoint(output: Path, head, optimizer, state: _State) -> None:
    save_eagle(head, output)
    mx.save_safetensors(str(output / OPTIMIZER), dict(tree_flatten(optimizer.state)))
    write_json(output / STATE, asdict(state))


def _save_copy(folder: Path, head, dtype: str) -> None:
    copy = EagleHead(head.config)
    copy.update(tree_map(lambda a: a.astype(getattr(mx, dtype)) if mx.issubdtype(a.dtype, mx.floating) else a,
                         head.parameters()))
    save_eagle(copy, folder)
