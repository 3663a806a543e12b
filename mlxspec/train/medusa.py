"""Medusa-1 training: K heads on the frozen target's cached hidden states.

Cai et al. 2024, "Medusa" (arXiv 2401.10774), section 2.2.1 (Medusa-1) and the reference
``medusa/train/train_legacy.py``: head k reads h_t and is trained with cross-entropy against
token t + k + 2, summed over heads (each head's loss is its mean over the positions where it
has a target: assistant tokens only). The residual blocks start at zero and each head ends in
the target's LM head (shared, frozen: the default, a few MB on disk) or in its own copy of it
(``own_lm_head``, the original format). AdamW with linear warm-up and cosine decay.

``train_medusa`` is a generator of records (no printing): a ``StepRecord`` per batch and an
``EvalRecord`` (held-out top-1 accuracy per head) before training and after every epoch. It
checkpoints into its output folder (published layout + ``config.json``, optimizer state and
``trainer_state.json``) after every epoch and every ``save_every`` steps, and resumes from there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..heads.medusa import MedusaConfig, MedusaHeads, load_medusa, save_medusa
from ..taps import logits_width, output_head
from .features import LABELS, FeatureCache, write_json

STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
#: Settings that must match to resume a run.
RESUME_KEYS = ("num_heads", "num_layers", "own_lm_head", "labels", "batch_size", "seed", "train_vocab")


@dataclass(frozen=True)
class MedusaTrainConfig:
    """Settings of a Medusa-1 run.

    Attributes:
        num_heads: K heads (head k predicts token t + k + 2).
        num_layers: Residual blocks per head (1 as published).
        own_lm_head: Give each head its own LM head, initialised from the target's (large files);
            otherwise heads share the target's frozen LM head.
        labels: ``"data"`` (the text's tokens, Medusa-1) or ``"target"`` (the target's greedy
            predictions of the same tokens; see ``features.LABELS``).
        epochs: Passes over the training features.
        batch_size: Positions per step.
        learning_rate: Peak learning rate (Medusa uses 1e-3).
        warmup_steps: Linear warm-up steps before the cosine decay to 0.
        weight_decay: AdamW weight decay.
        seed: Seed of the batch order.
        save_every: Also checkpoint every this many steps (0: only after each epoch).
        max_eval_positions: Held-out positions scored per evaluation.
        save_dtype: dtype of the per-epoch copies in ``epoch-<n>/`` (the resume checkpoint is float32).
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
    epochs: int = 1
    batch_size: int = 256
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    seed: int = 0
    save_every: int = 0
    max_eval_positions: int = 4096
    save_dtype: str = "float16"
    train_vocab: int = 0

    def __post_init__(self):
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        for name in ("num_heads", "num_layers", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning-rate must be > 0, got {self.learning_rate}")
        if self.train_vocab < 0:
            raise ValueError(f"train-vocab must be >= 0 (0: full vocabulary), got {self.train_vocab}")


@dataclass(frozen=True)
class StepRecord:
    """One optimiser step.

    Attributes:
        epoch: Epoch index, from 0.
        step: Steps done in this epoch (1-based).
        steps_per_epoch: Steps in an epoch.
        loss: Summed loss over heads (nats).
        head_losses: Per-head mean cross-entropy (nats), [K].
        positions: Positions in the batch that carry a target.
        step_s: Wall time of the step, seconds.
    """

    epoch: int
    step: int
    steps_per_epoch: int
    loss: float
    head_losses: list[float]
    positions: int
    step_s: float


@dataclass(frozen=True)
class EvalRecord:
    """Held-out accuracy after ``epoch`` epochs (0 = before training).

    Attributes:
        epoch: Epochs finished.
        accuracy: Top-1 accuracy per head against the text's token t + k + 2, [K].
        target_accuracy: Top-1 agreement per head with the target's greedy token, [K] (what
            greedy verification accepts, with the text as context).
        target_top10: The target's greedy token is in the head's top 10, [K] (tree ranks < 10).
        positions: Held-out positions scored.
        train_loss: Mean training loss over the epoch (``None`` before training).
        checkpoint: Folder of this epoch's heads (``None`` before training).
    """

    epoch: int
    accuracy: list[float]
    target_accuracy: list[float]
    target_top10: list[float]
    positions: int
    train_loss: float | None = None
    checkpoint: str | None = None


@dataclass
class _State:
    config: dict
    features: str
    epoch: int = 0
    step: int = 0
    global_step: int = 0
    history: list[dict] = field(default_factory=list)


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
             max_positions: int = 4096) -> EvalRecord:
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
    return EvalRecord(0, [a / n for a, n in zip(data, counts)], [a / n for a, n in zip(target, counts)],
                      [a / n for a, n in zip(top10, counts)], seen)


def train_medusa(target: nn.Module, train: FeatureCache, heldout: FeatureCache | None, output: str | Path,
                 config: MedusaTrainConfig, *, resume: bool = True) -> Iterator[StepRecord | EvalRecord]:
    """Train Medusa-1 heads on cached features, checkpointing into ``output``.

    Args:
        target: The frozen target (its LM head scores shared-head heads).
        train: Training features.
        heldout: Held-out features for the per-epoch accuracy, or ``None``.
        output: Checkpoint folder: ``config.json`` + ``medusa_lm_head.safetensors`` (latest, float32),
            ``optimizer.safetensors``, ``trainer_state.json``, and ``epoch-<n>/`` per epoch.
        config: Settings.
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        ``EvalRecord`` before training (fresh runs) and after each epoch; ``StepRecord`` per step.

    Raises:
        ValueError: ``output`` holds a run with other settings or features (when resuming), or
            ``resume`` is false and ``output`` already holds a run.
    """
    output = Path(output)
    lm_head = output_head(target)
    per_epoch = train.steps_per_epoch(config.num_heads, config.batch_size)
    state, heads, optimizer = _start(target, train, output, config, resume, per_epoch * config.epochs)
    if state.global_step == 0 and heldout is not None and not state.history:
        record = evaluate(heads, lm_head, heldout, batch_size=config.batch_size,
                          max_positions=config.max_eval_positions)
        state.history.append(asdict(record))
        yield record
    remap, train_head = _training_vocab(target, train, config)
    step = _compiled_step(heads, optimizer, train_head)
    for epoch in range(state.epoch, config.epochs):
        losses = []
        batches = train.batches(config.num_heads, config.batch_size, epoch=epoch, seed=config.seed)
        for i, batch in enumerate(batches):
            if i < state.step:  # resuming inside an epoch: same order, skip what was done
                continue
            t0 = time.perf_counter()
            labels, valid = batch.labels if config.labels == "data" else batch.greedy_labels, batch.valid
            if remap is not None:
                labels = remap[labels]
                valid = valid * (labels >= 0)
                labels = mx.maximum(labels, 0)
            loss, per_head = step(batch.hidden, labels, valid)
            mx.eval(loss, per_head, heads.parameters(), optimizer.state)
            losses.append(loss.item())
            state.step, state.global_step = i + 1, state.global_step + 1
            if config.save_every and state.step % config.save_every == 0:
                _checkpoint(output, heads, optimizer, state)
            yield StepRecord(epoch, i + 1, per_epoch, losses[-1], per_head.tolist(),
                             int(batch.valid.max(axis=0).sum().item()), time.perf_counter() - t0)
        yield _end_epoch(epoch, losses, heads, optimizer, lm_head, heldout, output, config, state)


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


def _compiled_step(heads: MedusaHeads, optimizer, lm_head):
    """One AdamW step on a batch, compiled; returns (loss, per-head losses)."""
    loss_and_grad = nn.value_and_grad(heads, partial(medusa_loss, lm_head=lm_head))
    state = [heads.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(hidden, labels, valid):
        (loss, per_head), grads = loss_and_grad(heads, hidden, labels, valid)
        optimizer.update(heads, grads)
        return loss, per_head

    return step


def _end_epoch(epoch: int, losses: list[float], heads, optimizer, lm_head, heldout, output: Path,
               config: MedusaTrainConfig, state: _State) -> EvalRecord:
    """Save ``epoch-<n>/``, score the held-out set, checkpoint; the epoch's ``EvalRecord``."""
    state.epoch, state.step = epoch + 1, 0
    folder = output / f"epoch-{epoch + 1}"
    _save_copy(folder, heads, config.save_dtype)
    record = EvalRecord(0, [], [], [], 0)
    if heldout is not None:
        record = evaluate(heads, lm_head, heldout, batch_size=config.batch_size,
                          max_positions=config.max_eval_positions)
    mean_loss = sum(losses) / len(losses) if losses else None
    record = EvalRecord(epoch + 1, record.accuracy, record.target_accuracy, record.target_top10,
                        record.positions, mean_loss, str(folder))
    state.history.append(asdict(record))
    _checkpoint(output, heads, optimizer, state)
    return record


def warmup_cosine(learning_rate: float, warmup_steps: int, total_steps: int):
    """Linear warm-up from 0 over ``warmup_steps`` (capped below ``total_steps``), then cosine decay to 0
    over the remaining steps: the schedule every trainer here uses."""
    warmup = min(warmup_steps, max(total_steps - 1, 0))
    decay = optim.cosine_decay(learning_rate, max(total_steps - warmup, 1))
    if warmup == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(0.0, learning_rate, warmup), decay], [warmup])


def _start(target, train: FeatureCache, output: Path, config: MedusaTrainConfig, resume: bool, total_steps: int):
    """Fresh heads and optimiser, or the ones checkpointed in ``output``."""
    schedule = warmup_cosine(config.learning_rate, config.warmup_steps, total_steps)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=config.weight_decay)
    fresh = _State(asdict(config), str(train.directory.resolve()))
    path = output / STATE
    if not path.is_file():
        heads = init_heads(target, config)
        optimizer.init(heads.trainable_parameters())
        return fresh, heads, optimizer
    if not resume:
        raise ValueError(f"{output} already holds a training run; resume it or pass a fresh --output")
    state = _State(**json.loads(path.read_text()))
    changed = [k for k in RESUME_KEYS if state.config.get(k) != fresh.config[k]]
    if changed or state.features != fresh.features:
        what = ", ".join(changed) or "the training features"
        raise ValueError(f"{output} holds a run with different {what}; use the same settings to resume, "
                         "or pass a fresh --output")
    state.config = fresh.config
    hidden_size, vocab_size = target_shape(target)
    heads = load_medusa(output, hidden_size=hidden_size, vocab_size=vocab_size)
    optimizer.init(heads.trainable_parameters())
    optimizer.state = tree_unflatten(list(mx.load(str(output / OPTIMIZER)).items()))
    return state, heads, optimizer


def _checkpoint(output: Path, heads: MedusaHeads, optimizer, state: _State) -> None:
    save_medusa(output, heads)
    mx.save_safetensors(str(output / OPTIMIZER), dict(tree_flatten(optimizer.state)))
    write_json(output / STATE, asdict(state))


def _save_copy(folder: Path, heads: MedusaHeads, dtype: str) -> None:
    copy = MedusaHeads(heads.config)
    copy.update(tree_map(lambda a: a.astype(getattr(mx, dtype)), heads.parameters()))
    save_medusa(folder, copy)
