"""``mlxspec train draft``: distil a small independent draft model from a target's corpus.

``mlxspec train draft --model default --corpus CORPUS --layers 4 --hidden 256 --output DIR`` loads the
target in float32 (only its config, embeddings and tokenizer are used: the soft labels come from the
corpus built by ``mlxspec train corpus``), measures one decode step of the draft against one of the
target, trains with a progress bar and prints the held-out KL, expected α and top-1 agreement after
every epoch. ``DIR/epoch-N`` is an mlx-lm model folder for ``--draft-model``. Running the same command
again resumes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mlx.utils import tree_flatten

from ...loading.models import describe, load
from ...core.taps import model_body
from ...train.draft import draft_step_ms, init_draft, train_draft
from ...train.draft_data import DraftEvalRecord, DraftTrainConfig
from .shared import add_run_flags, make_config, open_corpus, say, train_with_progress

HELP = "distil a small independent draft model (mlx-lm folder) from a corpus"
DESCRIPTION = ("Train a small decoder of the target's family on the target's soft labels (KL on a corpus "
               "from 'mlxspec train corpus'); run the same command again to resume.")
RUN_INFO = "run.json"
#: The draft's flags: config field → help (see ``shared.add_config_flags``).
FLAGS = {
    "layers": "decoder layers of the draft",
    "hidden": "hidden size of the draft; the target's embeddings are projected to it (SVD)",
    "heads": ("attention heads. Default: hidden / the target's head size", {"type": int}),
    "kv_heads": ("key/value heads. Default: the target's query/KV ratio where it divides", {"type": int}),
    "intermediate_size": (
        "MLP width. Default: the target's ratio to the hidden size, a multiple of 64",
        {"type": int},
    ),
    "batch_tokens": "tokens per step, padding included",
    "max_seq_length": "cut examples (prompt + answer) to this many tokens",
    "heldout_examples": "with no validation corpus, hold out this many examples from the end of the corpus",
    "train_vocab": "normalise the training loss over only the N tokens most frequent among the soft labels "
    "(0: the full vocabulary); the 49k-wide LM head and softmax dominate a CPU step. The draft keeps its "
    "full LM head and the held-out scores use it",
    "negatives": "with --train-vocab: tokens sampled from the rest of the vocabulary each step, whose logits "
    "stand for the rest in the softmax (sampled softmax)",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train draft`` flags: the shared run flags and the draft's shape."""
    add_run_flags(
        p,
        DraftTrainConfig(),
        FLAGS,
        output_help="folder for checkpoints (itself an mlx-lm model folder, float32), epoch-N/ copies and "
        "run info",
        corpus_help="a corpus from 'mlxspec train corpus' (its train/ part is trained on, its validation/ "
        "part scores each epoch), or one corpus folder (the last --heldout-examples are held out)",
    )


def run(args: argparse.Namespace) -> int:
    """``mlxspec train draft``: corpus → draft model folder; writes ``OUTPUT/run.json``."""
    config = make_config(DraftTrainConfig, args)
    train, heldout = open_corpus(args.corpus)
    output = Path(args.output).expanduser()
    model, tokenizer = load(args.model, dtype="float32")
    info = {"command": args.command, "args": vars(args), "target": describe(args.model, model),
            "corpus": {"train": str(train.directory), "heldout": str(heldout.directory) if heldout else None},
            **_describe_draft(model, config)}
    t0 = time.perf_counter()
    history = train_with_progress(train_draft(model, tokenizer, train, heldout, output, config), scores)
    info["train_s"] = round(time.perf_counter() - t0, 1)
    info["history"] = history
    (output / RUN_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
    last = next((h for h in reversed(history) if h.get("checkpoint")), None)
    if last:
        say(f"draft model in {last['checkpoint']} ({config.save_dtype}); try: mlxspec generate --model "
            f"{args.model} --draft-model {last['checkpoint']} --prompt ...")
    return 0


def _describe_draft(model, config: DraftTrainConfig) -> dict:
    """Say the draft's shape, size and decode step against the target's; the same as run-info fields."""
    draft, model_config = init_draft(model, config)
    draft_ms, target_ms = draft_step_ms(draft), draft_step_ms(model)
    params = sum(v.size for _, v in tree_flatten(draft.parameters()))
    embed = model_body(draft).embed_tokens.weight.size
    say(f"draft: {config.layers} layers, hidden {config.hidden}, {model_config['num_attention_heads']} heads "
        f"({model_config['num_key_value_heads']} KV), MLP {model_config['intermediate_size']}; "
        f"{params / 1e6:.1f}M parameters ({embed / 1e6:.1f}M in the tied embedding/LM head)")
    say(f"decode step, float32: draft {draft_ms:.1f} ms, target {target_ms:.1f} ms "
        f"(ratio 1/{target_ms / max(draft_ms, 1e-9):.1f})")
    return {"draft_config": model_config, "parameters": int(params),
            "step_ms": {"draft": round(draft_ms, 2), "target": round(target_ms, 2)}}


def scores(record: DraftEvalRecord) -> str:
    """Held-out KL, the top-K α estimate at temperature 1 and top-1 agreement (α at temperature 0)."""
    return (f"held-out KL {record.kl:.3f}, expected α {record.alpha:.3f} (temperature 1, top-K lower bound), "
            f"top-1 agreement {record.top1:.3f} (α at temperature 0) [{record.positions} positions]")
