"""DSpark drafter training on a self-distillation corpus of the frozen target (docs/heads.md 9.3).

DSpark (DeepSeek's DeepSpec, arXiv 2607.05147) is DFlash's block backbone plus a serial low-rank
Markov head and a confidence head (``heads.dspark``). It trains on DFlash's blocks (``train.dflash``:
packed examples, seeded anchors, one forward per batch) with three changes:

- **Rows.** A fresh drafter uses the published layout (``sample_from_anchor``): block row j − 1
  scores draft j, so a block of B positions proposes P = B tokens. One initialised from a trained
  DFlash checkpoint (``init_dflash``) keeps DFlash's rows (row j scores draft j, P = B − 1), so its
  backbone's rows keep what they learnt.
- **Draft loss.** Soft cross-entropy of q_j = softmax(b_j + W2 W1[y_{j−1}]) against the target's
  stored top-K distribution of the token at anchor + j (renormalised, over the union of the batch's
  top-K ids as in DFlash), position j weighted ``position_decay ** (j − 1)``. The Markov input is
  teacher-forced: y_{j−1} is the text's token before position j (y_0 the anchor), which is what the
  drafter reads at inference whenever positions < j were accepted. W2 starts at zero, so an
  untrained Markov head adds nothing (a drafter initialised from DFlash starts drafting exactly as it).
- **Confidence loss.** The confidence head c_j = σ(w · [h_j, W1[y_{j−1}]] + b) is trained with binary
  cross-entropy, added to the draft loss, at ``confidence_lr_scale`` times the learning rate, on the
  observed event

      A_j = [argmax_x (b_j + W2 W1[y_{j−1}])(x) = g_j],

  g_j the target's greedy token at anchor + j given the text before it: the drafter's own greedy
  draft at position j, over the full vocabulary, with the current weights, agrees with the target.
  With teacher forcing the positions before j carry the text's tokens, so on a corpus of the target's
  own greedy answers A_j is exactly "position j survives greedy verification, given that positions
  < j survived", the conditional survival whose running product ``Draft.survival`` hands to
  ``--num-draft-tokens scheduled``. Its gradient stops at h_j and W1[y_{j−1}]: the confidence head
  reads the drafter, it does not move it. At temperature > 0 the same c_j estimates the greedy
  event (the scheduler recalibrates it online on observed acceptance,
  ``pacing.scheduled.SurvivalCalibration``).
- **Held-out scores** each epoch: DFlash's per-position acceptance (A_j itself), chain acceptance and
  τ, plus the confidence head's calibration: the mean c_j per position, the Brier score of c_j
  against A_j and its expected calibration error (10 equal-width bins), and the Brier score of the
  predicted survival Π_{i≤j} c_i against the observed chain survival.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..heads.dflash import load_dflash
from ..heads.dspark import DSparkConfig, DSparkNet, load_dspark, save_dspark
from ..pacing import NUM_BINS
from .dflash import (
    RESUME_KEYS as DFLASH_RESUME_KEYS,
    BlockBatch,
    DFlashEvalRecord,
    DFlashTask,
    DFlashTrainConfig,
    backbone_config,
    block_batches,
    block_hidden,
    chain_record,
    fold_feature_scale,
    plan_epoch,
)
from .eagle import soft_ce
from .features import FeatureCache, folded_copy
from .loop import EvalRecord, StepRecord, fit

#: Settings that must match to resume a run (with the loop's own).
RESUME_KEYS = DFLASH_RESUME_KEYS + ("markov_rank", "confidence_lr_scale", "init_dflash")


@dataclass(frozen=True)
class DSparkTrainConfig(DFlashTrainConfig):
    """Settings of a DSpark run: DFlash's (``DFlashTrainConfig``) and these.

    Attributes:
        markov_rank: r, the rank of the Markov head's transition bias W2 W1[x].
        confidence_lr_scale: The confidence head's learning rate is the run's times this: a linear read-out
            of the drafter, trained only by its own BCE, that learns too slowly at the backbone's rate.
        init_dflash: A trained DFlash drafter folder whose backbone (and row layout) this one starts
            from; ``""``: a fresh backbone, seeded.
    """

    markov_rank: int = 32
    confidence_lr_scale: float = 10.0
    init_dflash: str = ""

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov-rank must be >= 1, got {self.markov_rank}")
        if self.confidence_lr_scale <= 0:
            raise ValueError(f"confidence-lr-scale must be > 0, got {self.confidence_lr_scale}")


@dataclass(frozen=True)
class DSparkEvalRecord(DFlashEvalRecord):
    """Held-out acceptance and confidence calibration after ``epoch`` epochs (0 = before training).

    Attributes (besides DFlash's ``acceptance``, ``chain_acceptance``, ``tau``, ``positions``, here per
    draft j = 1 … P with the Markov head reading the text's previous token):
        confidence: Mean c_j per draft position (compare with ``acceptance``).
        brier: Mean (c_j − A_j)² over the scored positions (0 is perfect; 0.25 is a constant 0.5 on a
            fair coin).
        calibration_error: Expected calibration error of c_j: Σ_bins (n_bin / n) · |mean c − mean A|
            over ``pacing.NUM_BINS`` equal-width bins.
        survival: Mean predicted survival Π_{i≤j} c_i per position (compare with ``chain_acceptance``).
        survival_brier: Mean (Π_{i≤j} c_i − Π_{i≤j} A_i)² over blocks with every position scored.
    """

    confidence: list[float]
    brier: float
    calibration_error: float
    survival: list[float]
    survival_brier: float


def first_row(net: DSparkNet) -> int:
    """The block row that scores draft 1: 0 with ``sample_from_anchor`` (the published default), else 1."""
    return 0 if net.dspark.sample_from_anchor else 1


# --- the forward on teacher-forced blocks -------------------------------------------------------


def draft_rows(net: DSparkNet, batch: BlockBatch, embed) -> tuple[mx.array, mx.array]:
    """The rows that score drafts 1 … P: hidden [Nb, P, H] and the teacher-forced previous tokens [Nb, P]."""
    start, P = first_row(net), net.dspark.proposals
    return block_hidden(net, batch, embed)[:, start : start + P], batch.previous[:, start : start + P]


def dspark_loss(net: DSparkNet, batch: BlockBatch, embed, lm_weight: mx.array, scored: mx.array,
                greedy: mx.array) -> tuple[mx.array, mx.array]:
    """Draft loss plus the confidence head's BCE (module docstring), one forward.

    Args:
        net: The drafter.
        batch: A ``BlockBatch`` made with ``first_row(net)``.
        embed: The target's token embedding.
        lm_weight: The target's LM head as a matrix, [V, H] float32.
        scored: Flat indices into [Nb * B] of the block rows with a greedy label, [m] int32.
        greedy: The target's greedy token there, [m] int32.

    Returns:
        tuple: the loss (scalar, nats) and its parts: mean CE per draft position [P], then the BCE.
    """
    hidden = block_hidden(net, batch, embed)  # [Nb, B, H]
    flat, prev = hidden.reshape(-1, hidden.shape[-1]), batch.previous.reshape(-1)  # [Nb B, H], [Nb B]
    w1, w2 = net.markov_head.markov_w1, net.markov_head.markov_w2.weight  # W1: [V, r] table; W2: [V, r]
    rows, e = flat[batch.rows], w1(prev[batch.rows])  # [n, H], [n, r]
    logits = rows @ lm_weight[batch.union_ids].T + e @ w2[batch.union_ids].T  # [n, U]
    ce = soft_ce(logits, batch.label_ids, batch.label_probs)  # [n]
    per_position = (batch.onehot @ ce) / mx.maximum(batch.onehot.sum(-1), 1.0)
    draft = (batch.weights * ce).sum() / mx.maximum(batch.weights.sum(), 1e-6)
    h, e = mx.stop_gradient(flat[scored]), mx.stop_gradient(w1(prev[scored]))  # [m, H], [m, r]
    hit = (mx.argmax(h @ lm_weight.T + e @ w2.T, axis=-1) == greedy).astype(mx.float32)  # A_j, [m]
    z = net.confidence_head.logits(h, e)  # [m]
    bce = (mx.logaddexp(0.0, z) - hit * z).mean() if scored.size else mx.array(0.0)
    return draft + bce, mx.concatenate([per_position, bce[None]])


def scored_positions(batch: BlockBatch) -> tuple[mx.array, mx.array]:
    """``(scored, greedy)`` of ``dspark_loss``: the block rows with a greedy label (flat, [m]) and the label
    [m]."""
    grid = batch.greedy.reshape(-1)  # [Nb B]; -1 in rows that score no draft
    index = np.flatnonzero(grid >= 0)
    return mx.array(index.astype(np.int32)), mx.array(grid[index].astype(np.int32))


# --- held-out acceptance and calibration ------------------------------------------------------


def evaluate(net: DSparkNet, embed, lm_head, cache: FeatureCache, config: DSparkTrainConfig,
             mask_token_id: int, scale: np.ndarray | None = None) -> DSparkEvalRecord:
    """Held-out acceptance and calibration (see ``DSparkEvalRecord``), blocks in corpus order until about
    ``config.max_eval_positions`` draft positions are scored."""
    start, P = first_row(net), net.dspark.proposals
    hits, confidence, seen = [], [], 0
    plan = plan_epoch(cache, config, shuffle=False)
    for batch in block_batches(cache, plan, config, mask_token_id, epoch=0, first_row=start, scale=scale):
        if seen >= config.max_eval_positions:
            break
        hidden, previous = draft_rows(net, batch, embed)  # [Nb, P, H], [Nb, P]
        bias, e = net.markov_head(previous)  # [Nb, P, V], [Nb, P, r]
        guess = np.array(mx.argmax(lm_head(hidden) + bias, axis=-1))  # [Nb, P]
        greedy = batch.greedy[:, start : start + P]
        hits.append(np.where(greedy >= 0, guess == greedy, -1))  # -1: nothing to score
        confidence.append(np.array(net.confidence_head(hidden, e)))
        seen += int((greedy >= 0).sum())
    grid = np.concatenate(hits) if hits else np.zeros((0, P), int)
    c = np.concatenate(confidence) if confidence else np.zeros((0, P), np.float32)
    return DSparkEvalRecord(**chain_record(grid), positions=seen, **calibration(grid, c))


def calibration(grid: np.ndarray, confidence: np.ndarray) -> dict:
    """The confidence fields of ``DSparkEvalRecord`` from hits [n, P] (1, 0, or −1: unscored) and c [n, P]."""
    scored = grid >= 0
    c, a = confidence[scored], grid[scored].astype(np.float64)
    bins = np.minimum((c * NUM_BINS).astype(int), NUM_BINS - 1)
    ece = sum(abs(c[bins == b].mean() - a[bins == b].mean()) * (bins == b).sum() for b in np.unique(bins))
    full = scored.all(axis=1)
    predicted, observed = np.cumprod(confidence[full], axis=1), np.cumprod(grid[full] == 1, axis=1)
    mean = lambda x: float(x.mean()) if x.size else 0.0  # noqa: E731
    return {"confidence": [mean(confidence[:, j][scored[:, j]]) for j in range(grid.shape[1])],
            "brier": mean((c - a) ** 2), "calibration_error": float(ece / max(len(c), 1)),
            "survival": [mean(predicted[:, j]) for j in range(grid.shape[1])],
            "survival_brier": mean((predicted - observed) ** 2)}


# --- the task on the shared loop ---------------------------------------------------------------


def init_net(target: nn.Module, config: DSparkTrainConfig, aux_layers: list[int]) -> DSparkNet:
    """A fresh drafter (published row layout) on a ``backbone_config`` backbone, or one whose backbone and
    rows come from ``config.init_dflash``; the Markov head's W2 starts at zero.

    Raises:
        ValueError: the DFlash checkpoint's layers, block size or feature layers differ from the run's.
        FileNotFoundError: no DFlash checkpoint there.
    """
    if not config.init_dflash:
        net = DSparkNet(DSparkConfig(backbone_config(target, config, aux_layers), config.markov_rank))
    else:
        net = _from_dflash(target, config, aux_layers)
    net.markov_head.markov_w2.weight = mx.zeros_like(net.markov_head.markov_w2.weight)
    mx.eval(net.parameters())
    return net


def _from_dflash(target: nn.Module, config: DSparkTrainConfig, aux_layers: list[int]) -> DSparkNet:
    dflash = load_dflash(config.init_dflash, target=target, dtype=mx.float32)
    c, fix = dflash.config, "pass the DFlash run's --num-layers and --block-size, or no --init-dflash"
    if (c.num_hidden_layers, c.block_size) != (config.num_layers, config.block_size):
        raise ValueError(
            f"--init-dflash {config.init_dflash} has {c.num_hidden_layers} layers and block size "
            f"{c.block_size} but this run asks for {config.num_layers} and {config.block_size}; {fix}"
        )
    if c.context_window != config.context_window:
        raise ValueError(
            f"--init-dflash {config.init_dflash} was trained with --context-window {c.context_window} "
            f"but this run asks for {config.context_window}; pass the same window"
        )
    if list(c.feature_layers) != [int(i) for i in aux_layers]:
        raise ValueError(
            f"--init-dflash {config.init_dflash} reads target layers {list(c.target_layer_ids)} but the "
            f"corpus records the outputs of {[int(i) - 1 for i in aux_layers]}; train it on this corpus"
        )
    net = DSparkNet(DSparkConfig(c, config.markov_rank, sample_from_anchor=False))
    net.update(dflash.parameters())
    return net


class DSparkTask(DFlashTask):
    """DSpark on ``loop.fit``: DFlash's corpus, plans and batches, with the Markov and confidence heads.

    Args:
        target, train, heldout: As ``DFlashTask``.
        config: Settings.

    Raises:
        ValueError: a corpus that cannot train it (``train.dflash.check_corpus``).
    """

    resume_keys = RESUME_KEYS

    @property
    def learning_rate_scales(self) -> dict[str, float]:
        return {"confidence_head": self.config.confidence_lr_scale}

    def init(self) -> DSparkNet:
        # the initial weights are a function of the settings, like the batches
        mx.random.seed(self.config.seed)
        net = init_net(self.target, self.config, self.train.manifest["aux_layers"])
        if self.config.init_dflash:  # a saved DFlash drafter reads raw features
            net = fold_feature_scale(net, self.scale, unfold=True)
        return self._ready(net)

    def load(self, folder: Path) -> DSparkNet:
        net = fold_feature_scale(
            load_dspark(folder, target=self.target, dtype=mx.float32), self.scale, unfold=True
        )
        net.train()
        return self._ready(net)

    def _ready(self, net: DSparkNet) -> DSparkNet:
        self.first_row = first_row(net)
        return net

    def save(self, net: DSparkNet, folder: Path, dtype: str | None) -> None:
        save_dspark(folded_copy(net, lambda: DSparkNet(net.dspark), self.scale, dtype), folder)

    def batches(self, net, epoch: int, start: int) -> Iterator[BlockBatch]:
        return block_batches(
            self.train,
            self._plan(epoch),
            self.config,
            self.mask_token_id,
            epoch=epoch,
            start=start,
            first_row=self.first_row,
            scale=self.scale,
        )

    def loss(self, net: DSparkNet):
        return lambda batch, scored, greedy: dspark_loss(
            net, batch, self.embed, self.lm_weight, scored, greedy
        )

    def inputs(self, batch: BlockBatch, global_step: int) -> tuple:
        return (batch, *scored_positions(batch))

    def evaluate(self, net: DSparkNet) -> DSparkEvalRecord | None:
        if self.heldout is None:
            return None
        return evaluate(
            net, self.embed, self.lm_head, self.heldout, self.config, self.mask_token_id, self.scale
        )


def train_dspark(target: nn.Module, train: FeatureCache, heldout: FeatureCache | None, output: str | Path,
                 config: DSparkTrainConfig, *, resume: bool = True) -> Iterator[StepRecord | EvalRecord]:
    """Train a DSpark drafter on a self-distillation corpus (``loop.fit`` on a ``DSparkTask``).

    Args:
        target, train, heldout, config: As ``DSparkTask``.
        output: Checkpoint folder: ``config.json`` + ``model.safetensors`` (latest, float32, the published
            DSpark layout, loadable by ``load_dspark`` and ``--drafter dspark``), ``optimizer.safetensors``,
            ``trainer_state.json`` and ``epoch-<n>/`` per epoch in ``save_dtype``.
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        ``DSparkEvalRecord`` before training (fresh runs with held-out data) and after each epoch (a bare
        ``EvalRecord`` without held-out data); ``StepRecord`` per step (``parts``: mean CE per draft
        position, then the confidence BCE).

    Raises:
        ValueError: as ``DSparkTask``, ``init_net`` and ``loop.fit``.
        FileNotFoundError: no DFlash checkpoint at ``config.init_dflash``.
    """
    return fit(DSparkTask(target, train, heldout, config), output, config, resume=resume)
