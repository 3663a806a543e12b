"""MTP module training for a target that ships none, on a self-distillation corpus of the frozen target.

DeepSeek-V3 technical report (arXiv 2412.19437), section 2.2, trained after the fact on the target's
own answers (docs/heads.md 7.5). The corpus and its batches are EAGLE-1's (``eagle_data``: the target's
final-norm feature f_j, token j + 1, and the target's top-K distribution of token j + 2). The module
starts from the target's last decoder layer (``heads.mtp.init_mtp``) and shares its LM head.

Step 0 reads (f_j, token j + 1); step k > 0 reads the module's own step k - 1 output and token
j + 1 + k, with EAGLE-3's training-time-test attention (``train.eagle.unroll``, docs/heads.md 5.6),
which is what a chain draft sees at depth k + 1. Loss Σ_k decay^k · soft CE of the shared LM head on
the output against the target's top-K renormalised, with the softmax over the union of the batch's
top-K ids (a sampled softmax, as for EAGLE-1). Held-out agreement per depth is EAGLE's ``evaluate``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..heads.mtp import MTPStack, init_mtp, load_mtp, save_mtp
from .eagle import EagleTask, soft_ce, unroll
from ..core.taps import logits_width
from .eagle_data import EagleTrainConfig, SequenceBatch, draft_vocabulary, token_counts
from .features import FeatureCache
from .loop import EvalRecord, StepRecord, cast_copy, fit


@dataclass(frozen=True)
class MTPTrainConfig(EagleTrainConfig):
    """Settings of an MTP run: EAGLE-1's data and the loop's settings, with the unrolled loss of EAGLE-3.

    Attributes:
        ttt_steps: Unrolled steps in the loss (the chain depths trained), >= 1.
        eval_steps: Depths scored on the held-out corpus.
        version: Always 1 (the corpus layout EAGLE-1 reads: final-norm features, no layer inputs).
        noise: Not used by MTP (0).
        draft_vocab_size: The draft vocabulary written beside the module (``draft_vocab.safetensors``): the
            most frequent answer tokens of the corpus, which drafting samples from (docs/heads.md 7.4); 0:
            the whole vocabulary. Training always scores the whole vocabulary's top-K labels.
    """

    version: int = 1
    ttt_steps: int = 2
    eval_steps: int = 3
    noise: float = 0.0
    learning_rate: float = 1e-3

    def __post_init__(self):
        super().__post_init__()
        if self.version != 1:
            raise ValueError("MTP training reads the EAGLE-1 corpus layout; version must be 1")

    @property
    def train_steps(self) -> int:
        return self.ttt_steps


def mtp_loss(stack: MTPStack, batch: SequenceBatch, embed, lm_weight: mx.array,
             config: MTPTrainConfig) -> tuple[mx.array, mx.array]:
    """Σ_k decay^k · CE_k over ``config.ttt_steps`` unrolled steps (docs/heads.md 7.5).

    Args:
        stack: The module being trained.
        batch: An EAGLE-1 ``SequenceBatch`` (labels for every step; ``union_ids``).
        embed: The target's token embedding.
        lm_weight: The target's LM head, [V, H] float32.
        config: Steps and their decay.

    Returns:
        tuple: total loss (scalar) and the per-step mean soft cross-entropies [S] (nats).
    """
    outs = unroll(stack, embed, batch.features, batch.tokens, config.train_steps)
    head = lm_weight[batch.union_ids]  # [U, H]
    per_step = []
    for k, x in enumerate(outs):
        rows = x.reshape(-1, x.shape[-1])[batch.rows[k]]  # [n_k, H]
        ce = soft_ce(rows @ head.T, batch.label_ids[k], batch.label_probs[k]).sum()
        per_step.append(ce / max(int(batch.rows[k].shape[0]), 1))
    per_step = mx.stack(per_step)
    weights = mx.array([config.step_decay**k for k in range(len(outs))])
    return (weights * per_step).sum(), per_step


class MTPTask(EagleTask):
    """An MTP module on ``loop.fit``, over EAGLE-1's corpus and batches and with its held-out scores.

    Args:
        target: The frozen target (float32).
        train: The training corpus (``mlxspec.train.corpus``).
        heldout: A held-out corpus for the per-epoch agreement, or ``None``.
        config: Settings.

    Raises:
        ValueError: a corpus lacks what training needs, or was made by another model.
    """

    def init(self) -> MTPStack:
        return init_mtp(self.target)

    def load(self, folder: Path) -> MTPStack:
        stack = load_mtp(folder, self.target, dtype=mx.float32)
        stack.train()
        return stack

    def save(self, stack: MTPStack, folder: Path, dtype: str | None) -> None:
        save_mtp(cast_copy(stack, lambda: init_mtp(self.target), dtype), folder, self.target,
                 draft_ids=self.draft_ids())

    def draft_ids(self) -> np.ndarray | None:
        """The ``draft_vocab_size`` most frequent answer tokens of the training corpus, sorted (EAGLE-3's
        choice, ``eagle_data.draft_vocabulary``), or ``None`` for the whole vocabulary."""
        vocab, size = int(logits_width(self.target)), self.config.draft_vocab_size
        if not 0 < size < vocab:
            return None
        if getattr(self, "_draft_ids", None) is None:
            d2t, _ = draft_vocabulary(token_counts(self.train, vocab), size)
            self._draft_ids = (np.arange(size) + d2t).astype(np.int32)
        return self._draft_ids

    def loss(self, stack: MTPStack):
        return lambda batch: mtp_loss(stack, batch, self.embed, self.lm_weight, self.config)

    def inputs(self, batch: SequenceBatch, global_step: int) -> tuple:
        return (batch,)


def train_mtp(target: nn.Module, train: FeatureCache, heldout: FeatureCache | None, output: str | Path,
              config: MTPTrainConfig, *, resume: bool = True) -> Iterator[StepRecord | EvalRecord]:
    """Train an MTP module for ``target`` (``loop.fit`` on an ``MTPTask``).

    Args:
        target, train, heldout, config: As ``MTPTask``.
        output: Checkpoint folder: the module in the DeepSeek layout (``config.json`` +
            ``model.safetensors``, float32, which ``heads.mtp.load_mtp`` and ``--mtp-weights`` read),
            ``optimizer.safetensors``, ``trainer_state.json`` and ``epoch-<n>/`` in ``save_dtype``.
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        ``EagleEvalRecord`` before training and after each epoch (held-out agreement per depth);
        ``StepRecord`` per step (``parts``: soft CE per unrolled step).

    Raises:
        ValueError: as ``MTPTask`` and ``loop.fit``.
    """
    return fit(MTPTask(target, train, heldout, config), output, config, resume=resume)
