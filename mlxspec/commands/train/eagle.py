"""``mlxspec train eagle``: an EAGLE-1 or EAGLE-3 head for a target, from a self-distillation corpus.

``mlxspec train eagle --model default --corpus CORPUS --version 3 --output DIR`` loads the target
in float32, trains the head on ``CORPUS/train`` (built by ``mlxspec train corpus``) with a
progress bar, prints the held-out agreement on ``CORPUS/validation`` after every epoch and
writes ``DIR/training.json``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from ...loading import load
from ...train.eagle import train_eagle
from ...train.eagle_data import EagleEvalRecord, EagleTrainConfig
from .shared import add_run_flags, make_config, open_corpus, say, train_with_progress

HELP = "an EAGLE-1 or EAGLE-3 head on the frozen target, from a corpus"
DESCRIPTION = ("Train an EAGLE-1 or EAGLE-3 draft head on a self-distillation corpus (mlxspec train corpus); "
               "run the same command again to resume.")
TRAINING_RECORD = "training.json"
#: The head's flags: config field → help (see ``shared.add_config_flags``).
FLAGS = {
    "version": ("1: EAGLE-1 (final-norm feature, target LM head, feature regression + 0.1 soft CE); "
                "3: EAGLE-3 (three target layers, reduced vocabulary, training-time test)", {"choices": (1, 3)}),
    "draft_vocab_size": "EAGLE-3 draft vocabulary: the most frequent answer tokens of the corpus (0: the whole "
                        "target vocabulary)",
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
    add_run_flags(p, EagleTrainConfig(), FLAGS,
                  output_help="folder for the head (config.json + model.safetensors, EAGLE layout), checkpoints "
                              "and training.json",
                  corpus_help="corpus folder from 'mlxspec train corpus' (the target's own answers with its "
                              "features, EAGLE-3 layer inputs and top-k log-probabilities); its validation part "
                              "scores each epoch")


def run(args: argparse.Namespace) -> int:
    """``mlxspec train eagle``: corpus → head; writes ``OUTPUT/training.json``."""
    config = make_config(EagleTrainConfig, args)
    train_cache, heldout_cache = open_corpus(args.corpus)
    output = Path(args.output).expanduser()
    model, _ = load(args.model, dtype="float32")
    t0 = time.perf_counter()
    history = train_with_progress(train_eagle(model, train_cache, heldout_cache, output, config), scores)
    record = {
        "command": args.command, "target": args.model, "version": config.version,
        "config": dataclasses.asdict(config),
        "corpus": {"train": str(train_cache.directory), "heldout": str(heldout_cache.directory)
                   if heldout_cache else None, "train_tokens": train_cache.num_tokens,
                   "train_answer_tokens": train_cache.manifest.get("masked_tokens")},
        "train_s": round(time.perf_counter() - t0, 1), "heldout": history,
    }
    (output / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    last = next((h["checkpoint"] for h in reversed(history) if h["checkpoint"]), None)
    copy = f" and {last} ({config.save_dtype})" if last else ""
    say(f"head in {output} (float32, resumable){copy}; record in {output / TRAINING_RECORD}")
    return 0


def scores(record: EagleEvalRecord) -> str:
    """Held-out agreement with the target's greedy token per unrolled step, the chain acceptance and τ."""
    def fmt(values):
        return " ".join(f"{v:.3f}" for v in values)

    return (f"held-out agreement with the target's greedy token per step: {fmt(record.acceptance)}; "
            f"chain {fmt(record.chain_acceptance)}; τ ≈ {record.tau:.2f} [{record.positions} positions]")
