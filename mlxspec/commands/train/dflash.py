"""``mlxspec train dflash``: a DFlash block drafter for a target, from a self-distillation corpus.

``mlxspec train dflash --model default --corpus CORPUS --output DIR`` loads the target in float32,
trains the drafter on ``CORPUS/train`` (built by ``mlxspec train corpus``) with a progress bar,
prints the held-out per-position acceptance on ``CORPUS/validation`` after every epoch and writes
``DIR/training.json``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from ...loading import load
from ...train.dflash import DFlashEvalRecord, DFlashTrainConfig, train_dflash
from .shared import add_run_flags, make_config, open_corpus, say, train_with_progress

HELP = "a DFlash block drafter on the frozen target, from a corpus"
DESCRIPTION = ("Train a DFlash drafter (a few layers on the target's layer features that predict a whole block "
               "of masked tokens at once) on a self-distillation corpus (mlxspec train corpus); run the same "
               "command again to resume.")
TRAINING_RECORD = "training.json"
#: The drafter's flags: config field → help (see ``shared.add_config_flags``).
FLAGS = {
    "num_layers": "drafter decoder layers (each as wide as the target's)",
    "block_size": "positions per block, the anchor included (at most BLOCK_SIZE - 1 drafts a round)",
    "anchors_per_example": "most anchors (blocks) drawn per example and epoch",
    "batch_tokens": "context positions per step (whole examples packed end to end)",
    "max_seq_length": "cut examples to this many tokens",
    "mask_token_id": "the id whose embedding fills the masked positions (-1: the last id of the vocabulary)",
    "position_decay": "loss weight of block position j is DECAY**(j-1)",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train dflash`` flags: the shared run flags and the drafter's."""
    add_run_flags(p, DFlashTrainConfig(), FLAGS,
                  output_help="folder for the drafter (config.json + model.safetensors, z-lab's DFlash layout), "
                              "checkpoints and training.json",
                  corpus_help="corpus folder from 'mlxspec train corpus' (the target's own answers with its layer "
                              "features and top-k log-probabilities); its validation part scores each epoch")


def run(args: argparse.Namespace) -> int:
    """``mlxspec train dflash``: corpus → drafter; writes ``OUTPUT/training.json``."""
    config = make_config(DFlashTrainConfig, args)
    train_cache, heldout_cache = open_corpus(args.corpus)
    output = Path(args.output).expanduser()
    model, _ = load(args.model, dtype="float32")
    t0 = time.perf_counter()
    history = train_with_progress(train_dflash(model, train_cache, heldout_cache, output, config), scores)
    train_s = time.perf_counter() - t0
    record = {
        "command": args.command, "target": args.model, "config": dataclasses.asdict(config),
        "corpus": {"train": str(train_cache.directory), "heldout": str(heldout_cache.directory)
                   if heldout_cache else None, "train_tokens": train_cache.num_tokens,
                   "train_answer_tokens": train_cache.manifest.get("masked_tokens")},
        "train_s": round(train_s, 1), "heldout": history,
    }
    (output / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    last = next((h["checkpoint"] for h in reversed(history) if h["checkpoint"]), None)
    copy = f" and {last} ({config.save_dtype})" if last else ""
    say(f"drafter in {output} (float32, resumable){copy}; record in {output / TRAINING_RECORD}")
    return 0


def scores(record: DFlashEvalRecord) -> str:
    """Held-out agreement with the target's greedy token per block position, the chain acceptance and τ."""
    def fmt(values):
        return " ".join(f"{v:.3f}" for v in values)

    return (f"held-out agreement with the target's greedy token per block position: {fmt(record.acceptance)}; "
            f"chain {fmt(record.chain_acceptance)}; τ ≈ {record.tau:.2f} [{record.positions} positions]")
