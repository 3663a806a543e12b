"""``mlxspec train eagle``: an EAGLE-1 or EAGLE-3 head for a target, from a self-distillation corpus.

``mlxspec train eagle --model default --corpus CORPUS --version 3 --output DIR`` loads the target
in float32, trains the head on ``CORPUS/train`` (built by ``mlxspec train corpus``) with a
progress bar, prints the held-out agreement on ``CORPUS/validation`` after every epoch and
writes ``DIR/training.json``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse

from ...train.eagle import train_eagle
from ...train.eagle_data import EagleEvalRecord, EagleTrainConfig
from .shared import add_run_flags, chain_scores, corpus_help, run_on_corpus

HELP = "an EAGLE-1 or EAGLE-3 head on the frozen target, from a corpus"
DESCRIPTION = ("Train an EAGLE-1 or EAGLE-3 draft head on a self-distillation corpus (mlxspec train corpus); "
               "run the same command again to resume.")
#: The head's flags: config field → help (see ``shared.add_config_flags``).
FLAGS = {
    "version": (
        "1: EAGLE-1 (final-norm feature, target LM head, feature regression + 0.1 soft CE); 3: EAGLE-3 "
        "(three target layers, reduced vocabulary, training-time test)",
        {"choices": (1, 3)},
    ),
    "draft_vocab_size": "EAGLE-3 draft vocabulary: the most frequent answer tokens of the corpus (0: the "
    "whole target vocabulary)",
    "ttt_steps": "EAGLE-3 training-time-test steps (the head's own outputs fed back)",
    "step_decay": "weight of unrolled step k is DECAY**k",
    "eval_steps": "unrolled steps scored on the held-out corpus",
    "ce_weight": "EAGLE-1: weight of the soft cross-entropy next to the regression",
    "noise": "EAGLE-1: uniform feature noise scale (0: none)",
    "batch_tokens": "padded tokens per step (whole examples of similar length)",
    "max_seq_length": "cut examples to this many tokens",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train eagle`` flags: the shared run flags and the head."""
    add_run_flags(
        p,
        EagleTrainConfig(),
        FLAGS,
        output_help="folder for the head (config.json + model.safetensors, EAGLE layout), checkpoints and "
        "training.json",
        corpus_help=corpus_help("features, EAGLE-3 layer inputs and top-k log-probabilities"),
    )


def run(args: argparse.Namespace) -> int:
    """``mlxspec train eagle``: corpus → head; writes ``OUTPUT/training.json``."""
    return run_on_corpus(args, EagleTrainConfig, train_eagle, scores, "head", top_fields=("version",))


def scores(record: EagleEvalRecord) -> str:
    """Held-out agreement with the target's greedy token per unrolled step, the chain acceptance and τ."""
    return chain_scores(record, "step")
