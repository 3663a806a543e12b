"""DFlash drafter training on a self-distillation corpus of the frozen target (docs/heads.md 8.4).

DFlash (z-lab, arXiv 2602.06036): sample anchor positions in the target's own answers, replace the
B − 1 tokens after each anchor by the mask token, and train the drafter to predict all of them in
one forward from the anchor, the masks and the target's features of the positions before the
anchor. The corpus (``mlxspec.train.corpus``) holds per token t: the token, whether it is an answer
token, the residual streams entering three target layers (``aux``: the outputs of the layers before
them, which become the drafter's ``target_layer_ids``), the target's greedy next token and its top-K
log-softmax (the distribution of token t + 1).

- **Batches.** Whole examples are packed end to end into one context of at most ``batch_tokens``
  positions (RoPE is relative, so packing changes nothing once each block sees only its own
  example, or only its last ``context_window`` positions); each example contributes up to
  ``anchors_per_example`` anchors, drawn by a generator seeded with (seed, epoch, chunk, example), so a
  resumed run replays the same blocks. A block at anchor a sees the context positions of its example before a,
  and its own B positions.
- **Loss.** Soft cross-entropy at every block position whose token is an answer token, against the
  target's stored top-K distribution renormalised; the drafter's softmax runs over the union of the
  batch's top-K ids (a sampled softmax, as for EAGLE-1 in ``train/eagle.py``: the 49k-wide LM head
  dominates a CPU step otherwise). Position j is weighted ``position_decay ** (j - 1)``.
- **Feature preconditioning.** Training feeds ``fc`` the features divided by their per-dimension RMS
  over the corpus (``features.feature_scale``: Qwen2.5's massive residual dimensions) and folds the
  division into ``fc``'s columns whenever it saves (``fold_feature_scale``), so a saved drafter reads
  raw features exactly as the published layout does; loading for a resumed run unfolds it.
- **Held-out acceptance.** Per block position j, the drafter's argmax against the target's greedy
  token there. The drafter never reads its own drafts, so on a greedy corpus this is exactly what
  greedy verification of its chain accepts: chain acceptance at j is the fraction of blocks whose
  first j positions all agree, τ = 1 + Σ_j chain acceptance.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..heads.dflash import DFlashConfig, DFlashNet, load_dflash, save_dflash
from ..core.taps import logits_width, model_body, output_head
from .eagle import lm_head_matrix, soft_ce
from .features import (
    FeatureCache,
    check_corpus_arrays,
    chunk_batches,
    chunk_spans,
    feature_scale,
    fold_feature_scale,
    folded_copy,
)
from .loop import EpochPlans, EvalRecord, StepRecord, TrainConfig, fit

#: Settings that must match to resume a run (with the loop's own).
RESUME_KEYS = (
    "num_layers",
    "block_size",
    "anchors_per_example",
    "batch_tokens",
    "max_seq_length",
    "mask_token_id",
    "position_decay",
    "max_steps",
    "context_window",
)


@dataclass(frozen=True)
class DFlashTrainConfig(TrainConfig):
    """Settings of a DFlash run: the loop's (``TrainConfig``) and these.

    Attributes:
        num_layers: Drafter decoder layers L.
        block_size: B, positions per block including the anchor.
        anchors_per_example: Most anchors (blocks) drawn per example and epoch.
        batch_tokens: Context positions per batch (whole examples packed end to end).
        max_seq_length: Examples are cut to this many tokens.
        mask_token_id: The id that fills masked positions; ``-1`` = the last id of the target's vocabulary.
        position_decay: Loss weight of block position j is ``position_decay ** (j - 1)`` (our choice:
            early positions decide a chain's acceptance).
        context_window: Each block sees only the last W context positions before its anchor, in
            training and (stored in the drafter's config) at inference; 0 = all. A 1-position window
            learns from scratch on a CPU budget where the full context sits on the unigram
            (docs/archive/dflash.md 4.1).
    """

    num_layers: int = 2
    block_size: int = 8
    anchors_per_example: int = 16
    batch_tokens: int = 2048
    max_seq_length: int = 1024
    mask_token_id: int = -1
    position_decay: float = 0.9
    context_window: int = 0
    learning_rate: float = 1e-3
    grad_clip: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        for name, least in (
            ("num_layers", 1),
            ("block_size", 2),
            ("anchors_per_example", 1),
            ("batch_tokens", 1),
            ("max_seq_length", 3),
            ("mask_token_id", -1),
            ("context_window", 0),
        ):
            if getattr(self, name) < least:
                raise ValueError(f"{name.replace('_', '-')} must be >= {least}, got {getattr(self, name)}")
        if not 0 < self.position_decay <= 1:
            raise ValueError(f"position-decay must be in (0, 1], got {self.position_decay}")


@dataclass(frozen=True)
class DFlashEvalRecord(EvalRecord):
    """Held-out acceptance after ``epoch`` epochs (0 = before training).

    Attributes:
        acceptance: Per block position j = 1 … B − 1: agreement of the drafter's argmax with the
            target's greedy token (given the true earlier tokens, which a DFlash block never reads).
        chain_acceptance: Per j: fraction of blocks whose first j positions all agree (counted over
            blocks with a target at every position).
        tau: 1 + Σ_j chain_acceptance: the τ of greedy verification of a full block.
        positions: Held-out block positions scored.
    """

    acceptance: list[float]
    chain_acceptance: list[float]
    tau: float
    positions: int


def check_corpus(cache: FeatureCache, target: nn.Module | None = None) -> None:
    """Refuse a corpus that cannot train a DFlash drafter for ``target`` (one line naming the fix).

    Raises:
        ValueError: another model made it, it lacks the layer features or soft labels, or one of its
            feature layers is the embedding (no target layer output).
    """
    check_corpus_arrays(
        cache, target, {"tokens", "mask", "offsets", "greedy", "aux", "topk_ids", "topk_logprobs"}, "DFlash"
    )
    if min(cache.manifest.get("aux_layers") or [0]) < 1:
        raise ValueError(
            f"the corpus in {cache.directory} records the input of layer 0 (the embedding), which is "
            "no target layer's output; build it from a target with at least 4 layers"
        )


# --- batches of blocks -------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockBatch:
    """Packed examples and the blocks drawn from them (Nb blocks of B positions over S context positions).

    Attributes:
        features: Packed target features, [1, S, K H] float32.
        blocks: ``[anchor, MASK, …]`` per block, [Nb, B] int32.
        anchors: Each anchor's packed position, [Nb] int32.
        mask: What each block sees: its example's context before the anchor and its own block,
            [Nb, 1, 1, S + B] bool.
        rows: Flat indices into [Nb * B] of the loss positions (block rows), [n] int32.
        label_ids: Soft labels as indices into ``union_ids``, [n, K] int32.
        label_probs: Their probabilities, [n, K] float32 (rows sum to 1).
        union_ids: Target ids of the softmax's columns, [U] int32.
        weights: Loss weight per row, [n] float32; ``onehot``: row → draft position j − 1, [P, n].
        greedy: The target's greedy token at each block row, [Nb, B] int32 (−1: none to score).
        previous: The text's token before the one each row scores, [Nb, B] int32 (the anchor for draft 1;
            DSpark's teacher-forced Markov input; 0 in rows that score nothing).
    """

    features: mx.array
    blocks: mx.array
    anchors: mx.array
    mask: mx.array
    rows: mx.array
    label_ids: mx.array
    label_probs: mx.array
    union_ids: mx.array
    weights: mx.array
    onehot: mx.array
    greedy: np.ndarray
    previous: mx.array

    @property
    def positions(self) -> int:
        return int(self.rows.shape[0])


def plan_epoch(cache: FeatureCache, config: DFlashTrainConfig, *, epoch: int = 0, shuffle: bool = True
               ) -> list[tuple[int, list[tuple[int, int]]]]:
    """The batches of one epoch as ``(chunk, [(start, length), ...])``: examples packed up to
    ``batch_tokens`` positions, chunks and examples permuted by (seed, epoch[, chunk]) with ``shuffle``."""
    plan = []
    for c, spans in chunk_spans(cache, config.max_seq_length, seed=config.seed, epoch=epoch, shuffle=shuffle):
        if shuffle:
            spans = [spans[i] for i in np.random.default_rng([config.seed, epoch, c]).permutation(len(spans))]
        current, used = [], 0
        for span in spans:
            if current and used + span[1] > config.batch_tokens:
                plan.append((c, current))
                current, used = [], 0
            current.append(span)
            used += span[1]
        if current:
            plan.append((c, current))
    return plan


def _anchors(mask: np.ndarray, start: int, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``count`` example-local anchors i >= 1 whose next token is an answer token, ascending."""
    local = np.flatnonzero(mask[start + 2 : start + length]) + 1
    return np.sort(rng.choice(local, size=min(count, len(local)), replace=False)) if len(local) else local


def make_batch(arrays: dict, spans: list[tuple[int, int]], config: DFlashTrainConfig, mask_token_id: int, *,
               key: tuple[int, ...], first_row: int = 1, scale: np.ndarray | None = None) -> BlockBatch:
    """Materialise one batch from a loaded chunk (see ``BlockBatch``); ``key`` seeds the anchors; the features
    are divided by ``scale`` [K H] when given (``feature_scale``).

    ``first_row`` is the block row that scores draft 1: 1 in DFlash (row j scores the token at anchor
    + j), 0 in DSpark's published layout (row j − 1 does); drafts 1 … B − ``first_row`` are scored.
    """
    B, P = config.block_size, config.block_size - first_row
    aux, tokens = arrays["aux"], arrays["tokens"]
    feats, blocks, anchors, visible, greedy, previous, label_at = [], [], [], [], [], [], []
    packed, pad = 0, [-1] * first_row
    for s, length in spans:
        feats.append(aux[s : s + length].reshape(length, -1))
        rng = np.random.default_rng([*key, s])
        for i in _anchors(arrays["mask"], s, length, config.anchors_per_example, rng):
            blocks.append([tokens[s + i]] + [mask_token_id] * (B - 1))
            anchors.append(packed + i)
            visible.append(
                (
                    max(packed, packed + i - config.context_window) if config.context_window else packed,
                    packed + i,
                )
            )
            t, ok, target_greedy = _drafted(arrays, s + i, s + length, P)
            greedy.append(pad + np.where(ok & (target_greedy >= 0), target_greedy, -1).tolist())
            previous.append([0] * first_row + tokens[np.minimum(t, s + length) - 1].tolist())
            label_at.append(np.where(ok, t - 1, -1))  # top-K row holding the distribution of token t
        packed += length
    S, Nb = packed, len(blocks)
    lo, hi = np.array(visible).reshape(Nb, 2).T
    ctx = (np.arange(S)[None] >= lo[:, None]) & (np.arange(S)[None] < hi[:, None])
    mask = np.concatenate([ctx, np.ones((Nb, B), bool)], axis=1)[:, None, None]
    labels = _soft_labels(arrays, np.array(label_at).reshape(Nb, P), first_row, B, config.position_decay)
    features = np.concatenate(feats).astype(np.float32)
    features = features / scale if scale is not None else features
    return BlockBatch(
        mx.array(features[None]),
        mx.array(np.array(blocks, np.int32)),
        mx.array(np.array(anchors, np.int32)),
        mx.array(mask),
        *labels,
        np.array(greedy, np.int32).reshape(Nb, B),
        mx.array(np.array(previous, np.int32).reshape(Nb, B)),
    )


def _drafted(arrays: dict, anchor: int, end: int, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drafts 1 … P after the chunk position ``anchor`` of an example ending at ``end``: their chunk positions
    t [P], whether each is an answer token of the example [P], and the target's greedy choice for each [P]."""
    t = anchor + np.arange(1, P + 1)
    inside = np.minimum(t, end - 1)
    return t, (t < end) & arrays["mask"][inside], arrays["greedy"][inside - 1]


def _soft_labels(arrays: dict, label_at: np.ndarray, first_row: int, B: int, decay: float) -> list[mx.array]:
    """``BlockBatch``'s rows, label_ids, label_probs, union_ids, weights and onehot from the top-K row of each
    draft's token (``label_at`` [Nb, P], −1: none)."""
    Nb, P = label_at.shape
    rows_grid = np.arange(Nb * B).reshape(Nb, B)[:, first_row:]
    sel = label_at >= 0
    ids, probs = (
        arrays["topk_ids"][label_at[sel]],
        np.exp(arrays["topk_logprobs"][label_at[sel]].astype(np.float32)),
    )
    ok = probs.sum(-1) > 0
    ids, probs = ids[ok], probs[ok] / probs[ok].sum(-1, keepdims=True)
    rows, position = rows_grid[sel][ok], np.nonzero(sel)[1][ok]  # position: j - 1
    union = np.unique(ids)
    onehot = (position[None] == np.arange(P)[:, None]).astype(np.float32)
    return [mx.array(rows.astype(np.int32)), mx.array(np.searchsorted(union, ids).astype(np.int32)),
            mx.array(probs.astype(np.float32)), mx.array(union.astype(np.int32)),
            mx.array((decay**position).astype(np.float32)), mx.array(onehot)]


def block_batches(
    cache: FeatureCache,
    plan,
    config: DFlashTrainConfig,
    mask_token_id: int,
    *,
    epoch: int,
    start: int = 0,
    first_row: int = 1,
    scale: np.ndarray | None = None,
) -> Iterator[BlockBatch]:
    """Materialise ``plan[start:]``, one chunk in memory at a time; anchors keyed by (seed, epoch, chunk)."""
    return chunk_batches(cache, plan[start:], lambda arrays, c, spans: make_batch(
        arrays, spans, config, mask_token_id, key=(config.seed, epoch, c), first_row=first_row, scale=scale))


# --- loss and held-out acceptance --------------------------------------------------------------


def block_hidden(net: DFlashNet, batch: BlockBatch, embed) -> mx.array:
    """The drafter's final-normed hidden states of every block row, [Nb, B, H] (one forward)."""
    return net(embed(batch.blocks), net.fuse(batch.features), None, batch.anchors, batch.mask)  # [Nb, B, H]


def dflash_loss(net: DFlashNet, batch: BlockBatch, embed, lm_weight: mx.array) -> tuple[mx.array, mx.array]:
    """Weighted soft cross-entropy of all masked positions of all blocks at once (one forward).

    Args:
        net: The drafter.
        batch: A ``BlockBatch``.
        embed: The target's token embedding.
        lm_weight: The target's LM head as a matrix, [V, H] float32.

    Returns:
        tuple: the loss (scalar, nats; weighted mean over rows) and the mean CE per block position [B − 1].
    """
    hidden = block_hidden(net, batch, embed)
    rows = hidden.reshape(-1, hidden.shape[-1])[batch.rows]  # [n, H]
    ce = soft_ce(rows @ lm_weight[batch.union_ids].T, batch.label_ids, batch.label_probs)  # [n]
    per_position = (batch.onehot @ ce) / mx.maximum(batch.onehot.sum(-1), 1.0)
    return (batch.weights * ce).sum() / mx.maximum(batch.weights.sum(), 1e-6), per_position


def evaluate(net: DFlashNet, embed, lm_head, cache: FeatureCache, config: DFlashTrainConfig,
             mask_token_id: int, scale: np.ndarray | None = None) -> DFlashEvalRecord:
    """Held-out per-position acceptance (see ``DFlashEvalRecord``), blocks in corpus order until about
    ``config.max_eval_positions`` block positions are scored; ``scale``: as the training batches'."""
    hits, seen = [], 0
    plan = plan_epoch(cache, config, shuffle=False)
    for batch in block_batches(cache, plan, config, mask_token_id, epoch=0, scale=scale):
        if seen >= config.max_eval_positions:
            break
        guess = np.array(mx.argmax(lm_head(block_hidden(net, batch, embed)), axis=-1))  # [Nb, B]
        scored = batch.greedy[:, 1:] >= 0
        hits.append(np.where(scored, guess[:, 1:] == batch.greedy[:, 1:], -1))  # -1: nothing to score
        seen += int(scored.sum())
    grid = np.concatenate(hits) if hits else np.zeros((0, config.block_size - 1), int)
    return DFlashEvalRecord(**chain_record(grid), positions=seen)


def chain_record(grid: np.ndarray) -> dict:
    """``acceptance``, ``chain_acceptance`` and ``tau`` of a ``DFlashEvalRecord`` from the held-out hits
    [n blocks, P drafts]: 1 agrees with the target's greedy token, 0 not, −1 nothing to score. The chain
    acceptance counts the blocks with every draft scored."""
    acceptance = [float((col[col >= 0] == 1).mean()) if (col >= 0).any() else 0.0 for col in grid.T]
    full = grid[(grid >= 0).all(axis=1)]
    chain = np.cumprod(full == 1, axis=1).mean(axis=0).tolist() if len(full) else [0.0] * grid.shape[1]
    return {"acceptance": acceptance, "chain_acceptance": chain, "tau": 1.0 + sum(chain)}


# --- the task on the shared loop ---------------------------------------------------------------


def init_net(target: nn.Module, config: DFlashTrainConfig, aux_layers: list[int]) -> DFlashNet:
    """A fresh drafter (``backbone_config``), evaluated."""
    net = DFlashNet(backbone_config(target, config, aux_layers))
    mx.eval(net.parameters())
    return net


def backbone_config(target: nn.Module, config: DFlashTrainConfig, aux_layers: list[int]) -> DFlashConfig:
    """The shape of ``config.num_layers`` layers of ``target`` reading the outputs of the layers before the
    corpus's ``aux_layers`` (the inputs it recorded), with ``config``'s block size and mask id."""
    args, vocab = target.args, int(logits_width(target))
    return DFlashConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or args.num_attention_heads,
        head_dim=getattr(args, "head_dim", None),
        vocab_size=vocab,
        num_target_layers=len(model_body(target).layers),
        target_layer_ids=tuple(int(i) - 1 for i in aux_layers),
        block_size=config.block_size,
        mask_token_id=config.mask_token_id if config.mask_token_id >= 0 else vocab - 1,
        rms_norm_eps=args.rms_norm_eps,
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        max_position_embeddings=int(getattr(args, "max_position_embeddings", None) or 32768),
        context_window=config.context_window,
    )


class DFlashTask(EpochPlans):
    """DFlash on ``loop.fit``: one drafter over a self-distillation corpus of the frozen ``target``.

    Args:
        target: The frozen target (float32): its embedding, LM head and shape.
        train: The training corpus (``mlxspec train corpus``).
        heldout: A held-out corpus for the per-epoch acceptance, or ``None``.
        config: Settings.

    Raises:
        ValueError: a corpus that cannot train it (``check_corpus``).
    """

    resume_keys = RESUME_KEYS
    compile = False  # packed batches vary in shape
    plan_epoch = staticmethod(plan_epoch)

    def __init__(self, target: nn.Module, train: FeatureCache, heldout: FeatureCache | None,
                 config: DFlashTrainConfig):
        for cache in (train, heldout) if heldout is not None else (train,):
            check_corpus(cache, target)
        self.target, self.train, self.heldout, self.config = target, train, heldout, config
        self.data = str(train.directory.resolve())
        self.embed, self.lm_head = model_body(target).embed_tokens, output_head(target)
        self.lm_weight = lm_head_matrix(target)
        vocab = int(logits_width(target))
        self.mask_token_id = config.mask_token_id if config.mask_token_id >= 0 else vocab - 1
        self.scale = feature_scale(train)

    def init(self) -> DFlashNet:
        # the initial weights are a function of the settings, like the batches
        mx.random.seed(self.config.seed)
        return init_net(self.target, self.config, self.train.manifest["aux_layers"])

    def load(self, folder: Path) -> DFlashNet:
        net = fold_feature_scale(
            load_dflash(folder, target=self.target, dtype=mx.float32), self.scale, unfold=True
        )
        net.train()
        return net

    def save(self, net: DFlashNet, folder: Path, dtype: str | None) -> None:
        save_dflash(folded_copy(net, lambda: DFlashNet(net.config), self.scale, dtype), folder)

    def batches(self, net, epoch: int, start: int) -> Iterator[BlockBatch]:
        return block_batches(
            self.train,
            self._plan(epoch),
            self.config,
            self.mask_token_id,
            epoch=epoch,
            start=start,
            scale=self.scale,
        )

    def loss(self, net: DFlashNet):
        return lambda batch: dflash_loss(net, batch, self.embed, self.lm_weight)

    def inputs(self, batch: BlockBatch, global_step: int) -> tuple:
        return (batch,)

    def counts(self, batch: BlockBatch) -> tuple[int, int]:
        return batch.positions, int(batch.blocks.size + batch.features.shape[1])

    def evaluate(self, net: DFlashNet) -> DFlashEvalRecord | None:
        if self.heldout is None:
            return None
        return evaluate(
            net, self.embed, self.lm_head, self.heldout, self.config, self.mask_token_id, self.scale
        )


def train_dflash(target: nn.Module, train: FeatureCache, heldout: FeatureCache | None, output: str | Path,
                 config: DFlashTrainConfig, *, resume: bool = True) -> Iterator[StepRecord | EvalRecord]:
    """Train a DFlash drafter on a self-distillation corpus (``loop.fit`` on a ``DFlashTask``).

    Args:
        target, train, heldout, config: As ``DFlashTask``.
        output: Checkpoint folder: ``config.json`` + ``model.safetensors`` (latest, float32, z-lab's
            layout, loadable by ``load_dflash``), ``optimizer.safetensors``, ``trainer_state.json`` and
            ``epoch-<n>/`` per epoch in ``save_dtype``.
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        ``DFlashEvalRecord`` before training (fresh runs with held-out data) and after each epoch (a bare
        ``EvalRecord`` without held-out data); ``StepRecord`` per step (``parts``: mean CE per block
        position).

    Raises:
        ValueError: as ``DFlashTask`` and ``loop.fit``.
    """
    return fit(DFlashTask(target, train, heldout, config), output, config, resume=resume)
