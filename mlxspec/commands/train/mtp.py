"""``mlxspec train mtp``: a multi-token-prediction module for a target that ships none, from a corpus.

``mlxspec train mtp --model default --corpus CORPUS --output DIR`` loads the target in float32, trains
one MTP module (docs/mtp.md 3.1) on ``CORPUS/train`` (built by ``mlxspec train corpus``) with a
progress bar, prints the held-out agreement per depth on ``CORPUS/validation`` after every epoch and
writes ``DIR/training.json``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from ...loading import load
from ...train.mtp import MTPTrainConfig, train_mtp
from .eagle import scores
from .shared import add_run_flags, make_config, open_corpus, say, train_with_progress

HELP = "a multi-token-prediction (MTP) module on the frozen target, from a corpus"
DESCRIPTION = ("Train an MTP module (DeepSeek-V3 style: the target's last hidden state and the next token's "
               "embedding, one decoder block initialised from the target's last layer, the target's LM head) "
               "on a self-distillation corpus (mlxspec train corpus); run the same command again to resume.")
TRAINING_RECORD = "training.json"
FLAGS = {
    "ttt_steps": "chain depths in the loss: step k feeds the module its own step k-1 output",
    "step_decay": "weight of depth k is DECAY**k",
    "eval_steps": "depths scored on the held-out corpus",
    "batch_tokens": "padded tokens per step (whole examples of similar length)",
    "max_seq_length": "cut examples to this many tokens",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train mtp`` flags: the shared run flags and the module's."""
    add_run_flags(p, MTPTrainConfig(), FLAGS,
                  output_help="folder for the module (config.json + model.safetensors in the DeepSeek MTP layout, "
                              "which --mtp-weights loads), checkpoints and training.json",
                  corpus_help="corpus folder from 'mlxspec train corpus' (the target's own answers with its final "
                              "hidden states and top-k log-probabilities); its validation part scores each epoch")


def run(args: argparse.Namespace) -> int:
    """``mlxspec train mtp``: corpus → module; writes ``OUTPUT/training.json``."""
    config = make_config(MTPTrainConfig, args)
    train_cache, heldout_cache = open_corpus(args.corpus)
    output = Path(args.output).expanduser()
    model, _ = load(args.model, dtype="float32")
    t0 = time.perf_counter()
    history = train_with_progress(train_mtp(model, train_cache, heldout_cache, output, config), scores)
    record = {
        "command": args.command, "target": args.model, "config": dataclasses.asdict(config),
        "corpus": {"train": str(train_cache.directory), "heldout": str(heldout_cache.directory)
                   if heldout_cache else None, "train_tokens": train_cache.num_tokens,
                   "train_answer_tokens": train_cache.manifest.get("masked_tokens")},
        "train_s": round(time.perf_counter() - t0, 1), "heldout": history,
    }
    (output / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    last = next((h["checkpoint"] for h in reversed(history) if h["checkpoint"]), None)
    copy = f" and {last} ({config.save_dtype})" if last else ""
    say(f"MTP module in {output} (float32, resumable){copy}; record in {output / TRAINING_RECORD}")
    return 0
