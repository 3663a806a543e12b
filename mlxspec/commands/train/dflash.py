"""``mlxspec train dflash``: a DFlash block drafter for a target, from a self-distillation corpus.

``mlxspec train dflash --model default --corpus CORPUS --output DIR`` loads the target in float32,
trains the drafter on ``CORPUS/train`` (built by ``mlxspec train corpus``) with a progress bar,
prints the held-out per-position acceptance on ``CORPUS/validation`` after every epoch and writes
``DIR/training.json``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse

from ...train.dflash import DFlashEvalRecord, DFlashTrainConfig, train_dflash
from .shared import add_run_flags, chain_scores, corpus_help, run_on_corpus

HELP = "a DFlash block drafter on the frozen target, from a corpus"
DESCRIPTION = (
    "Train a DFlash drafter (a few layers on the target's layer features that predict a whole block of "
    "masked tokens at once) on a self-distillation corpus (mlxspec train corpus); run the same command again "
    "to resume."
)
#: The drafter's flags: config field → help (see ``shared.add_config_flags``).
FLAGS = {
    "num_layers": "drafter decoder layers (each as wide as the target's)",
    "block_size": "positions per block, the anchor included (at most BLOCK_SIZE - 1 drafts a round)",
    "anchors_per_example": "most anchors (blocks) drawn per example and epoch",
    "batch_tokens": "context positions per step (whole examples packed end to end)",
    "max_seq_length": "cut examples to this many tokens",
    "mask_token_id": "the id whose embedding fills the masked positions (-1: the last id of the vocabulary)",
    "position_decay": "loss weight of block position j is DECAY**(j-1)",
    "context_window": "each block sees only the last W context positions before its anchor, in training and "
    "at inference (0: all); 1 learns on a CPU budget where the full context stalls",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train dflash`` flags: the shared run flags and the drafter's."""
    add_run_flags(
        p,
        DFlashTrainConfig(),
        FLAGS,
        output_help="folder for the drafter (config.json + model.safetensors, z-lab's DFlash layout), "
        "checkpoints and training.json",
        corpus_help=corpus_help("layer features and top-k log-probabilities"),
    )


def run(args: argparse.Namespace) -> int:
    """``mlxspec train dflash``: corpus → drafter; writes ``OUTPUT/training.json``."""
    return run_on_corpus(args, DFlashTrainConfig, train_dflash, scores, "drafter")


def scores(record: DFlashEvalRecord) -> str:
    """Held-out agreement with the target's greedy token per block position, the chain acceptance and τ."""
    return chain_scores(record, "block position")
