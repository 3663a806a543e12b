"""Medusa-1 training: K heads on the frozen target's cached hidden states.

Cai et al. 2024, "Medusa" (arXiv 2401.10774), section 2.2.1 (Medusa-1) and the reference
``medusa/train/train_legacy.py``: head k reads h_t and is trained with cross-entropy against
token t + k + 2, summed over heads (each head's loss is its mean over the positions where it
has a target: assistant tokens only). The residual blocks start at zero and each head ends in
the target's LM head (shared, frozen: the default, a few MB on disk) or in its own copy of it
(``own_lm_head``, the original format). AdamW with linear warm-up and cosine decay.

``MedusaTask`` is this method on the shared loop (``loop.fit``): fresh heads, their published layout
on disk, batches of cached feature positions, the loss and the held-out accuracy; ``train_medusa``
runs it and yields the loop's records (a ``MedusaEvalRecord`` per evaluation).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..heads.medusa import MedusaConfig, MedusaHeads, load_medusa, save_medusa
from ..core.taps import logits_width, output_head
from .features import LABELS, Batch, FeatureCache
from .loop import EvalRecord, StepRecord, TrainConfig, cast_copy, fit

#: Settings that must match to resume a run (with the loop's own).
RESUME_KEYS = ("num_heads", "num_layers", "own_lm_head", "labels", "batch_size", "train_vocab")


@dataclass(frozen=True)
class MedusaTrainConfig(TrainConfig):
    """Settings of a Medusa-1 run: the loop's (``TrainConfig``) and these.

    Attributes:
        num_heads: K heads (head k predicts token t + k + 2).
        num_layers: Residual blocks per head (1 as published).
        own_lm_head: Give each head its own LM head, initialised from the target's (large files);
            otherwise heads share the target's frozen LM head.
        labels: ``"data"`` (the text's tokens, Medusa-1) or ``"target"`` (the target's greedy
            predictions of the same tokens; see ``features.LABELS``).
        batch_size: Positions per step.
        learning_rate: Peak learning rate (Medusa uses 1e-3).
        train_vocab: Score the training loss over only the this-many most frequent label tokens of the
            training data (0: the full vocabulary). The softmax over a 49k vocabulary dominates a step
            on a CPU; restricting it is the sampled-softmax idea (Jean et al. 2015, arXiv 1412.2007)
            with a fixed candidate set. Positions whose label falls outside the set are skipped.
            Heads keep the full LM head at inference and in the held-out accuracy.
    """

    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = False
    labels: str = "data"
    batch_size: int = 256
    learning_rate: float = 1e-3
    train_vocab: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        for name in ("num_heads", "num_layers", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.train_vocab < 0:
            raise ValueError(f"train-vocab must be >= 0 (0: full vocabulary), got {self.train_vocab}")


@dataclass(frozen=True)
class MedusaEvalRecord(EvalRecord):
    """Held-out accuracy after ``epoch`` epochs (0 = before training).

    Attributes:
        accuracy: Top-1 accuracy per head against the text's token t + k + 2, [K].
        target_accuracy: Top-1 agreement per head with the target's greedy token, [K] (what
            greedy verification accepts, with the text as context).
        target_top10: The target's greedy token is in the head's top 10, [K] (tree ranks < 10).
        positions: Held-out positions scored.
    """

    accuracy: list[float]
    target_accuracy: list[float]
    target_top10: list[float]
    positions: int


def medusa_loss(heads: MedusaHeads, hidden: mx.array, labels: mx.array, valid: mx.array, lm_head) -> tuple:
    """Σ_k mean CE(head_k(h_t), label_{k,t}) over the positions where head k has a target.

    Args:
        heads: The heads.
        hidden: h_t, shape [B, H], float32.
        labels: Targets, shape [K, B], int32.
        valid: 1 where head k has a target, shape [K, B], float32.
        lm_head: The target's LM head (used by shared-head heads).

    Returns:
        tuple: the summed loss (scalar) and the per-head losses [K].
    """
    logits = heads(hidden, lm_head)  # [K, B, V]
    ce = nn.losses.cross_entropy(logits, labels)  # [K, B]
    per_head = (ce * valid).sum(axis=1) / mx.maximum(valid.sum(axis=1), 1.0)  # [K]
    return per_head.sum(), per_head


def target_shape(target: nn.Module) -> tuple[int, int]:
    """The target's hidden size H and logits width V."""
    return int(target.args.hidden_size), int(logits_width(target))


def init_heads(target: nn.Module, config: MedusaTrainConfig) -> MedusaHeads:
    """Fresh heads for ``target``: zero residual blocks (each head starts as the target's next-token
    head); an own LM head starts as a copy of the target's."""
    lm_head = output_head(target)
    hidden_size = int(target.args.hidden_size)
    base = lm_head(mx.eye(hidden_size)).T.astype(mx.float32)  # [V, H]: works for tied and quantized heads
    shape = MedusaConfig(config.num_heads, hidden_size, base.shape[0], config.num_layers,
                         shared_lm_head=not config.own_lm_head)
    heads = MedusaHeads(shape)
    if config.own_lm_head:
        for head in heads.heads:
            head[-1].weight = mx.array(base)
    mx.eval(heads.parameters())
    return heads


def evaluate(heads: MedusaHeads, lm_head, cache: FeatureCache, *, batch_size: int = 256,
             max_positions: int = 4096) -> MedusaEvalRecord:
    """Top-1 accuracy per head on the first ``max_positions`` positions of ``cache`` (in cache order)."""
    k = heads.config.medusa_num_heads
    totals = mx.zeros((4, k))  # counts, data top-1, target top-1, target top-10
    seen = 0
    for batch in cache.batches(k, batch_size, shuffle=False):
        if seen >= max_positions:
            break
        logits = heads(batch.hidden, lm_head)  # [K, B, V]
        top1 = mx.argmax(logits, axis=-1)  # [K, B]
        top10 = mx.argpartition(-logits, kth=9, axis=-1)[..., :10]  # [K, B, 10]
        in_top10 = (top10 == batch.greedy_labels[..., None]).any(axis=-1)
        v = batch.valid
        totals = totals + mx.stack([v.sum(1), ((top1 == batch.labels) * v).sum(1),
                                    ((top1 == batch.greedy_labels) * v).sum(1), (in_top10 * v).sum(1)])
        mx.eval(totals)
        seen += int(batch.valid.max(axis=0).sum().item())
    counts, data, target, top10 = mx.maximum(totals, 1e-9).tolist()
    return MedusaEvalRecord([a / n for a, n in zip(data, counts)], [a / n for a, n in zip(target, counts)],
                            [a / n for a, n in zip(top10, counts)], seen)


class MedusaTask:
    """Medusa-1 on ``loop.fit``: heads over cached features of the frozen ``target``.

    Args:
        target: The frozen target (its LM head scores shared-head heads).
        train: Training features.
        heldout: Held-out features for the per-epoch accuracy, or ``None``.
        config: Settings.
    """

    resume_keys = RESUME_KEYS
    compile = True  # every batch is padded to batch_size: one graph

    def __init__(self, target: nn.Module, train: FeatureCache, heldout: FeatureCache | None,
                 config: MedusaTrainConfig):
        self.target, self.train, self.heldout, self.config = target, train, heldout, config
        self.data = str(train.directory.resolve())
        self.lm_head = output_head(target)
        self.remap, self.train_head = _training_vocab(target, train, config)

    def init(self) -> MedusaHeads:
        return init_heads(self.target, self.config)

    def load(self, folder: Path) -> MedusaHeads:
        hidden_size, vocab_size = target_shape(self.target)
        return load_medusa(folder, hidden_size=hidden_size, vocab_size=vocab_size)

    def save(self, heads: MedusaHeads, folder: Path, dtype: str | None) -> None:
        save_medusa(folder, cast_copy(heads, lambda: MedusaHeads(heads.config), dtype))

    def steps_in_epoch(self, epoch: int) -> int:
        return self.train.steps_per_epoch(self.config.num_heads, self.config.batch_size)

    def batches(self, heads, epoch: int, start: int) -> Iterator[Batch]:
        c = self.config
        return self.train.batches(c.num_heads, c.batch_size, epoch=epoch, seed=c.seed, start=start)

    def loss(self, heads: MedusaHeads):
        return lambda hidden, labels, valid: medusa_loss(heads, hidden, labels, valid, self.train_head)

    def inputs(self, batch: Batch, global_step: int) -> tuple[mx.array, mx.array, mx.array]:
        labels, valid = batch.labels if self.config.labels == "data" else batch.greedy_labels, batch.valid
        if self.remap is not None:
            labels = self.remap[labels]
            valid = valid * (labels >= 0)
            labels = mx.maximum(labels, 0)
        return batch.hidden, labels, valid

    def counts(self, batch: Batch) -> tuple[int, int]:
        positions = int(batch.valid.max(axis=0).sum().item())
        return positions, positions

    def evaluate(self, heads: MedusaHeads) -> MedusaEvalRecord | None:
        if self.heldout is None:
            return None
        return evaluate(heads, self.lm_head, self.heldout, batch_size=self.config.batch_size,
                        max_positions=self.config.max_eval_positions)


def train_medusa(target: nn.Module, train: FeatureCache, heldout: FeatureCache | None, output: str | Path,
                 config: MedusaTrainConfig, *, resume: bool = True) -> Iterator[StepRecord | EvalRecord]:
    """Train Medusa-1 heads on cached features, checkpointing into ``output`` (``loop.fit`` on a
    ``MedusaTask``).

    Args:
        target, train, heldout, config: As ``MedusaTask``.
        output: Checkpoint folder: ``config.json`` + ``medusa_lm_head.safetensors`` (latest, float32),
            ``optimizer.safetensors``, ``trainer_state.json``, and ``epoch-<n>/`` per epoch.
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        ``MedusaEvalRecord`` before training (fresh runs with held-out data) and after each epoch (a bare
        ``EvalRecord`` without held-out data); ``StepRecord`` per step (``parts``: per-head losses).

    Raises:
        ValueError: as ``loop.fit``.
    """
    return fit(MedusaTask(target, train, heldout, config), output, config, resume=resume)


def _training_vocab(target: nn.Module, train: FeatureCache, config: MedusaTrainConfig):
    """``(remap [V] int32 or None, LM head for the loss)``: with ``train_vocab``, the most frequent label
    tokens of ``train`` (answer tokens, and the target's greedy tokens), their rows of the LM head, and
    a map from token id to row (-1 outside the set)."""
    lm_head = output_head(target)
    if not config.train_vocab:
        return None, lm_head
    _, vocab_size = target_shape(target)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for c in range(train.num_chunks):
        arrays = train.load_chunk(c)
        counts += np.bincount(arrays["tokens"][arrays["mask"]], minlength=vocab_size)[:vocab_size]
        greedy = arrays["greedy"]
        counts += np.bincount(greedy[greedy >= 0], minlength=vocab_size)[:vocab_size]
    keep = np.sort(np.argsort(-counts, kind="stable")[: config.train_vocab])
    remap = np.full(vocab_size, -1, dtype=np.int32)
    remap[keep] = np.arange(len(keep), dtype=np.int32)
    rows = lm_head(mx.eye(int(target.args.hidden_size))).T[mx.array(keep)].astype(mx.float32)  # [V', H]
    mx.eval(rows)
    return mx.array(remap), lambda h: h @ rows.T
