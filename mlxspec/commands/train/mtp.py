"""``mlxspec train mtp``: a multi-token-prediction module for a target that ships none, from a corpus.

``mlxspec train mtp --model default --corpus CORPUS --output DIR`` loads the target in float32, trains
one MTP module (docs/heads.md 7.5) on ``CORPUS/train`` (built by ``mlxspec train corpus``) with a
progress bar, prints the held-out agreement per depth on ``CORPUS/validation`` after every epoch and
writes ``DIR/training.json``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse

from ...train.mtp import MTPTrainConfig, train_mtp
from .eagle import scores
from .shared import add_run_flags, corpus_help, run_on_corpus

HELP = "a multi-token-prediction (MTP) module on the frozen target, from a corpus"
DESCRIPTION = ("Train an MTP module (DeepSeek-V3 style: the target's last hidden state and the next token's "
               "embedding, one decoder block initialised from the target's last layer, the target's LM head) "
               "on a self-distillation corpus (mlxspec train corpus); run the same command again to resume.")
FLAGS = {
    "ttt_steps": "chain depths in the loss: step k feeds the module its own step k-1 output",
    "step_decay": "weight of depth k is DECAY**k",
    "eval_steps": "depths scored on the held-out corpus",
    "draft_vocab_size": "draft vocabulary saved with the module (draft_vocab.safetensors): the most frequent "
    "answer tokens of the corpus, which drafting samples from, so a draft step reads that many rows of the "
    "LM head instead of all (0: the whole vocabulary)",
    "batch_tokens": "padded tokens per step (whole examples of similar length)",
    "max_seq_length": "cut examples to this many tokens",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train mtp`` flags: the shared run flags and the module's."""
    add_run_flags(
        p,
        MTPTrainConfig(),
        FLAGS,
        output_help="folder for the module (config.json + model.safetensors in the DeepSeek MTP layout, "
        "which --mtp-weights loads), checkpoints and training.json",
        corpus_help=corpus_help("final hidden states and top-k log-probabilities"),
    )


def run(args: argparse.Namespace) -> int:
    """``mlxspec train mtp``: corpus → module; writes ``OUTPUT/training.json``."""
    return run_on_corpus(args, MTPTrainConfig, train_mtp, scores, "MTP module")
