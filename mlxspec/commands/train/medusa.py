"""``mlxspec train medusa``: Medusa-1 heads on the frozen target, from conversations or a corpus.

``mlxspec train medusa --model default --data sharegpt --output DIR`` loads the target in
float32, splits the conversations by a fixed seed (the held-out prompts go to
``DIR/heldout_prompts.jsonl``), caches the target's hidden states on disk (resumable, reused by
later runs on the same data), trains Medusa-1 heads with a progress bar and prints held-out
top-1 accuracy per head after every epoch. ``--corpus`` trains on the target's own answers
instead. Running the same command again resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ...loading.models import load
from ...train import dataset
from ...train.features import DEFAULT_CHUNK_TOKENS, LABELS, FeatureCache, cache_dir_for, extract_features
from ...train.medusa import MedusaEvalRecord, MedusaTrainConfig, train_medusa
from .shared import (
    DEFAULT_MAX_PROMPT_TOKENS,
    HELDOUT_PROMPTS,
    add_data_flag,
    add_run_flags,
    fmt,
    heldout_split,
    make_config,
    open_corpus,
    say,
    train_with_progress,
)

HELP = "Medusa-1 heads on the frozen target"
DESCRIPTION = "Train Medusa-1 heads (frozen target) on conversations; run the same command again to resume."
DEFAULT_MAX_TOKENS_TOTAL = 200_000
DEFAULT_MAX_SEQ_LENGTH = 1024
DEFAULT_NUM_HELDOUT = 50
DEFAULT_HELDOUT_TOKENS = 16_384
RUN_INFO = "run.json"
#: The heads' flags: config field → help (see ``shared.add_config_flags``).
FLAGS = {
    "num_heads": "Medusa heads; head k predicts token t + k + 2",
    "num_layers": "residual blocks per head",
    "own_lm_head": "give each head its own LM head (original format, initialised from the target's; V×H per "
                   "head on disk) instead of sharing the target's frozen LM head",
    "labels": ("training targets: the text's tokens (Medusa-1) or the target's greedy predictions of them "
               "(self-distillation without generating)", {"choices": LABELS}),
    "batch_size": "positions (assistant tokens) per step",
    "train_vocab": "score the training loss over only this many most frequent label tokens (0: full "
                   "vocabulary; a large speed-up on CPUs)",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train medusa`` flags: the shared run flags, the heads and the data."""
    add_run_flags(
        p,
        MedusaTrainConfig(),
        FLAGS,
        output_help="folder for checkpoints (published Medusa layout), held-out prompts and run info",
        corpus_help="train on a corpus from 'mlxspec train corpus' (the target's own answers) instead of "
        "--data; its validation part scores each epoch",
        corpus_required=False,
    )
    add_data_flag(p)
    _data_flags(p)


def _data_flags(p: argparse.ArgumentParser) -> None:
    """How conversations become training and held-out features."""
    p.add_argument("--max-tokens-total", type=int, default=DEFAULT_MAX_TOKENS_TOTAL,
                   help="token budget of the training conversations (the feature extraction runs the "
                        f"target over this many tokens). Default: {DEFAULT_MAX_TOKENS_TOTAL}")
    p.add_argument("--max-seq-length", type=int, default=DEFAULT_MAX_SEQ_LENGTH,
                   help=f"truncate conversations to this many tokens. Default: {DEFAULT_MAX_SEQ_LENGTH}")
    p.add_argument("--num-heldout", type=int, default=DEFAULT_NUM_HELDOUT,
                   help="conversations held out (never trained on); their first prompts are written to "
                        f"OUTPUT/{HELDOUT_PROMPTS} for benchmarks. Default: {DEFAULT_NUM_HELDOUT}")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        help="held-out conversations are picked among those whose first prompt has at most this many tokens "
        "(keeps benchmarks short) and, for ShareGPT, that open a conversation "
        f"(ids ending in _0). Default: {DEFAULT_MAX_PROMPT_TOKENS}",
    )
    p.add_argument("--heldout-tokens", type=int, default=DEFAULT_HELDOUT_TOKENS,
                   help="token budget of the held-out conversations used for per-epoch accuracy. "
                        f"Default: {DEFAULT_HELDOUT_TOKENS}")
    p.add_argument("--features-dir", default=None,
                   help="root of the feature cache. Default: $MLXSPEC_CACHE/features")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help=f"tokens per feature-cache chunk. Default: {DEFAULT_CHUNK_TOKENS}")


def run(args: argparse.Namespace) -> int:
    """``mlxspec train medusa``: data → features → heads (or corpus → heads); writes ``OUTPUT/run.json``."""
    for flag in ("max_tokens_total", "max_seq_length", "heldout_tokens", "chunk_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    config = make_config(MedusaTrainConfig, args)
    output = Path(args.output).expanduser()
    info = {"command": args.command, "args": vars(args)}
    model, tokenizer = load(args.model, dtype="float32")
    if args.corpus is not None:
        train_cache, heldout_cache = open_corpus(args.corpus)
    else:
        train_cache, heldout_cache = _features(model, tokenizer, output, args, info)
    info["features"] = {"train": str(train_cache.directory),
                        "heldout": str(heldout_cache.directory) if heldout_cache else None}
    t0 = time.perf_counter()
    train_with_progress(train_medusa(model, train_cache, heldout_cache, output, config), scores)
    info["train_s"] = round(time.perf_counter() - t0, 1)
    (output / RUN_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
    say(f"heads in {output} (float32, resumable) and {output}/epoch-{config.epochs} ({config.save_dtype})")
    return 0


def _features(model, tokenizer, output: Path, args: argparse.Namespace, info: dict):
    """Split, tokenize and extract: ``(train, held-out or None)`` feature caches."""
    conversations, note = dataset.read_conversations(args.data)
    say(note)
    train_convs, heldout_convs = heldout_split(
        conversations, tokenizer, args.data, args.num_heldout, args.seed, args.max_prompt_tokens
    )
    prompts = dataset.heldout_prompts(heldout_convs)
    dataset.write_heldout_prompts(output / HELDOUT_PROMPTS, prompts)
    say(f"held out {len(prompts)} conversations (prompts in {output / HELDOUT_PROMPTS}); "
        f"{len(train_convs)} left for training")
    examples, heldout = _tokenize(tokenizer, train_convs, heldout_convs, args, info)
    t0 = time.perf_counter()
    train_cache = _extract(model, examples, "train", args)
    heldout_cache = _extract(model, heldout, "held-out", args) if heldout else None
    info["extract_s"] = round(time.perf_counter() - t0, 1)
    return train_cache, heldout_cache


def _tokenize(tokenizer, train_convs, heldout_convs, args, info):
    train_report, heldout_report = dataset.DataReport(), dataset.DataReport()
    examples = list(dataset.tokenize_conversations(
        tokenizer, train_convs, max_length=args.max_seq_length, max_tokens_total=args.max_tokens_total,
        report=train_report))
    heldout = list(dataset.tokenize_conversations(
        tokenizer, heldout_convs, max_length=args.max_seq_length, max_tokens_total=args.heldout_tokens,
        report=heldout_report))
    if not examples:
        raise ValueError(f"no training examples with assistant tokens in {args.data}")
    say(f"train: {train_report.summary()}")
    say(f"held-out: {heldout_report.summary()}")
    info["data"] = {"train": vars(train_report), "heldout": vars(heldout_report)}
    return examples, heldout


def _extract(model, examples, name: str, args) -> FeatureCache:
    directory = cache_dir_for(model, examples, root=args.features_dir, chunk_tokens=args.chunk_tokens)
    total = sum(len(ex.tokens) for ex in examples)
    with tqdm(total=total, desc=f"features ({name})", unit="tok", file=sys.stderr) as bar:
        for progress in extract_features(model, examples, directory, chunk_tokens=args.chunk_tokens):
            bar.update(progress.done - bar.n)
            bar.set_postfix(
                chunk=f"{progress.chunk + 1}/{progress.num_chunks}", tok_s=f"{progress.tokens_per_s:.0f}"
            )
    return FeatureCache(directory)


def scores(record: MedusaEvalRecord) -> str:
    """Held-out top-1 accuracy per head (text and target greedy) and the target's top-10 hit rate."""
    return (f"held-out top-1 per head: {fmt(record.accuracy)} (text), {fmt(record.target_accuracy)} "
            f"(target greedy), top-10 {fmt(record.target_top10)} [{record.positions} positions]")
