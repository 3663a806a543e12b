"""``mlxspec train dspark``: a DSpark drafter for a target, from a self-distillation corpus.

``mlxspec train dspark --model default --corpus CORPUS --output DIR`` loads the target in float32,
trains the drafter (DFlash's block backbone, a low-rank Markov head and a confidence head;
docs/heads.md 9.3) on ``CORPUS/train`` (built by ``mlxspec train corpus``) with a progress bar, prints the
held-out per-position acceptance and the confidence head's calibration on ``CORPUS/validation`` after
every epoch and writes ``DIR/training.json``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse

from ...train.dspark import DSparkEvalRecord, DSparkTrainConfig, train_dspark
from . import dflash
from .shared import add_run_flags, chain_scores, corpus_help, fmt, run_on_corpus

HELP = "a DSpark drafter (DFlash backbone, Markov and confidence heads) on the frozen target, from a corpus"
DESCRIPTION = (
    "Train a DSpark drafter (a DFlash block backbone, a serial low-rank Markov head and a confidence head "
    "for --num-draft-tokens scheduled) on a self-distillation corpus (mlxspec train corpus); run the same "
    "command again to resume."
)
#: The drafter's flags: DFlash's and these (config field → help, see ``shared.add_config_flags``).
FLAGS = {
    **dflash.FLAGS,
    "block_size": "positions per block, the anchor included: a fresh drafter proposes BLOCK_SIZE tokens a "
    "round, one initialised from DFlash BLOCK_SIZE - 1",
    "markov_rank": "rank r of the Markov head's transition bias W2 W1[previous token]",
    "confidence_lr_scale": "the confidence head (trained by binary cross-entropy on whether each draft "
    "agrees with the target's greedy token) learns at the learning rate times this",
    "init_dflash": "a trained DFlash drafter folder (mlxspec train dflash, same corpus, --num-layers and "
    "--block-size) whose backbone this one starts from, keeping DFlash's block rows. Default: a fresh "
    "backbone",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train dspark`` flags: the shared run flags and the drafter's."""
    add_run_flags(p, DSparkTrainConfig(), FLAGS,
                  output_help="folder for the drafter (config.json + model.safetensors, the published DSpark "
                              "layout that --dspark-heads loads), checkpoints and training.json",
                  corpus_help=corpus_help("layer features and top-k log-probabilities"))


def run(args: argparse.Namespace) -> int:
    """``mlxspec train dspark``: corpus → drafter; writes ``OUTPUT/training.json``."""
    return run_on_corpus(args, DSparkTrainConfig, train_dspark, scores, "drafter")


def scores(record: DSparkEvalRecord) -> str:
    """Held-out agreement per draft position, chain acceptance and τ, then the confidence head's
    calibration."""
    return (f"{chain_scores(record, 'draft position')}; confidence per position {fmt(record.confidence)}, "
            f"Brier {record.brier:.3f}, calibration error {record.calibration_error:.3f}, predicted survival "
            f"{fmt(record.survival)} (Brier {record.survival_brier:.3f})")
