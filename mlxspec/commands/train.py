"""``mlxspec train``: build a corpus (``corpus``), train draft heads (``medusa``) and measure drafters (``measure``).

``mlxspec train medusa --model default --data sharegpt --output DIR`` loads the target in
float32, splits the conversations by a fixed seed (the held-out prompts go to
``DIR/heldout_prompts.jsonl``), caches the target's hidden states on disk (resumable, reused by
later runs on the same data), trains Medusa-1 heads with a progress bar and prints held-out
top-1 accuracy per head after every epoch. Running the same command again resumes.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from .common import ArgumentParser, USER_ERRORS, fail

DEFAULT_MAX_TOKENS_TOTAL = 200_000
DEFAULT_MAX_SEQ_LENGTH = 1024
DEFAULT_NUM_HELDOUT = 50
DEFAULT_HELDOUT_TOKENS = 16_384
DEFAULT_MAX_PROMPT_TOKENS = 512
DEFAULT_CONTENDERS = ["ngram=--drafter ngram --num-draft-tokens 4",
                      "medusa chain_4=--drafter medusa --medusa-tree chain_4 --num-draft-tokens 4",
                      "medusa small_15=--drafter medusa --medusa-tree small_15 --num-draft-tokens 4"]
HELDOUT_PROMPTS = "heldout_prompts.jsonl"
RUN_INFO = "run.json"


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="mlxspec train", description="Train draft heads for a target model.")
    sub = parser.add_subparsers(dest="method", required=True)
    _medusa_flags(sub.add_parser(
        "medusa", help="Medusa-1 heads on the frozen target",
        description="Train Medusa-1 heads (frozen target) on conversations; run the same command again "
                    "to resume."))
    from .corpus import corpus_flags

    corpus_flags(sub.add_parser(
        "corpus", help="the target's own greedy answers + features, for training heads and drafts",
        description="Answer training prompts greedily with the target (batched) and store its hidden "
                    "states, layer features and top-k log-probabilities; run again to resume."))
    from .train_eagle import eagle_flags

    eagle_flags(sub.add_parser(
        "eagle", help="an EAGLE-1 or EAGLE-3 head on the frozen target, from a corpus",
        description="Train an EAGLE-1 or EAGLE-3 draft head on a self-distillation corpus "
                    "(mlxspec train corpus); run the same command again to resume."))
    from .train_draft import draft_flags

    draft_flags(sub.add_parser(
        "draft", help="distil a small independent draft model (mlx-lm folder) from a corpus",
        description="Train a small decoder of the target's family on the target's soft labels (KL on a corpus "
                    "from 'mlxspec train corpus'); run the same command again to resume."))
    _measure_flags(sub.add_parser(
        "measure", help="τ, acceptance and tokens/s of drafters on held-out prompts",
        description="Run prompts with plain decoding and each drafter configuration (float32 target); "
                    "print a Markdown table."))
    return parser


def _medusa_flags(p: argparse.ArgumentParser) -> None:
    from ..train.features import DEFAULT_CHUNK_TOKENS, LABELS
    from ..train.medusa import MedusaTrainConfig

    d = MedusaTrainConfig()
    p.add_argument("--model", default="default",
                   help="target: an mlx-lm folder, a Hugging Face repo id, a .gguf file or 'default'; "
                        "always loaded in float32. Default: default")
    p.add_argument("--data", default="sharegpt",
                   help="'sharegpt' (ShareGPT V3, fetched once) or a JSONL of conversations, one "
                        '{"messages": [{"role", "content"}]} or {"conversations": [{"from", "value"}]} '
                        "per line. Default: sharegpt")
    p.add_argument("--output", "-o", required=True,
                   help="folder for checkpoints (published Medusa layout), held-out prompts and run info")
    p.add_argument("--num-heads", type=int, default=d.num_heads,
                   help=f"Medusa heads; head k predicts token t + k + 2. Default: {d.num_heads}")
    p.add_argument("--num-layers", type=int, default=d.num_layers,
                   help=f"residual blocks per head. Default: {d.num_layers}")
    p.add_argument("--own-lm-head", action="store_true",
                   help="give each head its own LM head (original format, initialised from the target's; "
                        "V×H per head on disk) instead of sharing the target's frozen LM head")
    p.add_argument("--labels", choices=LABELS, default=d.labels,
                   help="training targets: the text's tokens (Medusa-1) or the target's greedy "
                        f"predictions of them (self-distillation without generating). Default: {d.labels}")
    p.add_argument("--max-tokens-total", type=int, default=DEFAULT_MAX_TOKENS_TOTAL,
                   help="token budget of the training conversations (the feature extraction runs the "
                        f"target over this many tokens). Default: {DEFAULT_MAX_TOKENS_TOTAL}")
    p.add_argument("--max-seq-length", type=int, default=DEFAULT_MAX_SEQ_LENGTH,
                   help=f"truncate conversations to this many tokens. Default: {DEFAULT_MAX_SEQ_LENGTH}")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"passes over the training data. Default: {d.epochs}")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"positions (assistant tokens) per step. Default: {d.batch_size}")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate,
                   help=f"peak AdamW learning rate (cosine decay to 0). Default: {d.learning_rate:g}")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help=f"linear warm-up steps. Default: {d.warmup_steps}")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"AdamW weight decay. Default: {d.weight_decay:g}")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="also checkpoint every N steps (0: after each epoch only). Default: 0")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of the train/held-out split and of the batch order. Default: {d.seed}")
    p.add_argument("--num-heldout", type=int, default=DEFAULT_NUM_HELDOUT,
                   help="conversations held out (never trained on); their first prompts are written to "
                        f"OUTPUT/{HELDOUT_PROMPTS} for benchmarks. Default: {DEFAULT_NUM_HELDOUT}")
    p.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   help="held-out conversations are picked among those whose first prompt has at most "
                        "this many tokens (keeps benchmarks short) and, for ShareGPT, that open a conversation "
                        f"(ids ending in _0). Default: {DEFAULT_MAX_PROMPT_TOKENS}")
    p.add_argument("--heldout-tokens", type=int, default=DEFAULT_HELDOUT_TOKENS,
                   help="token budget of the held-out conversations used for per-epoch accuracy. "
                        f"Default: {DEFAULT_HELDOUT_TOKENS}")
    p.add_argument("--eval-positions", type=int, default=d.max_eval_positions,
                   help=f"held-out positions scored per evaluation. Default: {d.max_eval_positions}")
    p.add_argument("--corpus", default=None,
                   help="train on a corpus from 'mlxspec train corpus' (the target's own answers) instead "
                        "of --data; its validation part scores each epoch")
    p.add_argument("--train-vocab", type=int, default=d.train_vocab,
                   help="score the training loss over only this many most frequent label tokens (0: full "
                        "vocabulary; a large speed-up on CPUs). Default: 0")
    p.add_argument("--features-dir", default=None,
                   help="root of the feature cache. Default: $MLXSPEC_CACHE/features")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help=f"tokens per feature-cache chunk. Default: {DEFAULT_CHUNK_TOKENS}")
    p.add_argument("--save-dtype", choices=("float16", "bfloat16", "float32"), default=d.save_dtype,
                   help=f"dtype of the per-epoch heads in OUTPUT/epoch-N. Default: {d.save_dtype}")


def _measure_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="target (any spec 'mlxspec generate' takes); loaded in float32. Default: default")
    p.add_argument("--contender", "-c", action="append", default=None, metavar="'NAME=FLAGS'",
                   help="a drafter configuration as 'mlxspec generate' flags, e.g. "
                        "'medusa small_15=--drafter medusa --medusa-tree small_15 --num-draft-tokens 4'; "
                        "repeat for each. Default: " + "; ".join(DEFAULT_CONTENDERS))
    p.add_argument("--prompts", required=True,
                   help=f'JSONL of {{"prompt": ...}} lines, e.g. the {HELDOUT_PROMPTS} written by training')
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts. Default: all")
    p.add_argument("--temps", nargs="+", type=float, default=[0.0, 0.7],
                   help="sampling temperatures. Default: 0 0.7")
    p.add_argument("--max-tokens", "-m", type=int, default=128, help="new tokens per run. Default: 128")
    p.add_argument("--seed", type=int, default=0, help="prompt i is run with seed SEED + i. Default: 0")
    p.add_argument("--engine-prompts", type=int, default=None,
                   help="generate with the drafters (for tokens/s) on the first N prompts only; τ and acceptance "
                        "are replayed from the plain runs on every prompt. Default: all")
    p.add_argument("--replay-only", nargs="+", default=[], metavar="NAME",
                   help="contenders to replay but never time (e.g. trees too wide for this machine)")
    p.add_argument("--plain-runs", default=None, metavar="JSONL",
                   help="reuse the plain runs (their tokens) of an earlier --output of the same prompts, "
                        "temperatures, --max-tokens and --seed instead of generating them again: replaying "
                        "new drafters then costs one target forward per prompt (prompts with engine runs still "
                        "get a fresh plain run, for a fair speed-up). Default: generate them")
    p.add_argument("--output", "-o", default=None,
                   help="write every run as JSONL here and the table beside it (.md). Default: print only")


def main(argv: list[str] | None = None) -> int:
    """Run ``mlxspec train``; returns the exit status (2 on user errors, printed as one line)."""
    argv = sys.argv[1:] if argv is None else argv
    args = setup_arg_parser().parse_args(argv)
    args.command = "mlxspec train " + shlex.join(argv)
    try:
        if args.method == "corpus":
            from .corpus import run_corpus

            return run_corpus(args)
        if args.method == "draft":
            from .train_draft import run_draft

            return run_draft(args)
        if args.method == "eagle":
            from .train_eagle import run_eagle

            return run_eagle(args)
        return run_medusa(args) if args.method == "medusa" else run_measure(args)
    except USER_ERRORS as e:
        return fail(str(e))


def _config(args):
    from ..train.medusa import MedusaTrainConfig

    for flag in ("max_tokens_total", "max_seq_length", "heldout_tokens", "chunk_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return MedusaTrainConfig(
        num_heads=args.num_heads, num_layers=args.num_layers, own_lm_head=args.own_lm_head, labels=args.labels,
        epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, seed=args.seed,
        save_every=args.save_every, max_eval_positions=args.eval_positions, save_dtype=args.save_dtype,
        train_vocab=args.train_vocab)


def run_medusa(args: argparse.Namespace) -> int:
    """``mlxspec train medusa``: data → features → heads."""
    from ..loading import load
    from ..train import dataset

    config = _config(args)
    output = Path(args.output).expanduser()
    info = {"command": args.command, "args": vars(args)}
    model, tokenizer = load(args.model, dtype="float32")
    if args.corpus is not None:
        train_cache, heldout_cache = open_corpus(args.corpus)
        info["features"] = {"train": str(train_cache.directory), "heldout": str(heldout_cache.directory)
                            if heldout_cache else None}
        t0 = time.perf_counter()
        _train(model, train_cache, heldout_cache, output, config)
        info["train_s"] = round(time.perf_counter() - t0, 1)
        (output / RUN_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
        _say(f"heads in {output} (float32, resumable) and {output}/epoch-{config.epochs} ({config.save_dtype})")
        return 0
    conversations, note = dataset.read_conversations(args.data)
    _say(note)
    def heldout_ok(conversation) -> bool:
        if args.data == dataset.SHAREGPT and not dataset.starts_a_conversation(conversation):
            return False  # a later part's first prompt ("continue") needs context it does not have
        return len(tokenizer.encode(dataset.first_prompt(conversation))) <= args.max_prompt_tokens

    train_convs, heldout_convs = dataset.split_conversations(
        conversations, num_heldout=args.num_heldout, seed=args.seed, heldout_ok=heldout_ok)
    prompts = dataset.heldout_prompts(heldout_convs)
    dataset.write_heldout_prompts(output / HELDOUT_PROMPTS, prompts)
    _say(f"held out {len(prompts)} conversations (prompts in {output / HELDOUT_PROMPTS}); "
         f"{len(train_convs)} left for training")
    examples, heldout = _tokenize(tokenizer, train_convs, heldout_convs, args, info)
    t0 = time.perf_counter()
    train_cache = _extract(model, examples, "train", args)
    heldout_cache = _extract(model, heldout, "held-out", args) if heldout else None
    info["extract_s"] = round(time.perf_counter() - t0, 1)
    info["features"] = {"train": str(train_cache.directory),
                        "heldout": str(heldout_cache.directory) if heldout_cache else None}
    t0 = time.perf_counter()
    _train(model, train_cache, heldout_cache, output, config)
    info["train_s"] = round(time.perf_counter() - t0, 1)
    (output / RUN_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
    _say(f"heads in {output} (float32, resumable) and {output}/epoch-{config.epochs} ({config.save_dtype})")
    return 0


def open_corpus(path: str):
    """``(train, validation or None)`` feature caches of a corpus folder from ``mlxspec train corpus``.

    Raises:
        FileNotFoundError: no corpus there.
    """
    from ..train.features import FeatureCache
    from .corpus import TRAIN, VALIDATION

    root = Path(path).expanduser()
    if not (root / TRAIN / "manifest.json").is_file():
        raise FileNotFoundError(f"no corpus in {root}; build one with: mlxspec train corpus --output {root}")
    validation = root / VALIDATION
    return FeatureCache(root / TRAIN), FeatureCache(validation) if (validation / "manifest.json").is_file() else None


def _tokenize(tokenizer, train_convs, heldout_convs, args, info):
    from ..train import dataset

    train_report, heldout_report = dataset.DataReport(), dataset.DataReport()
    examples = list(dataset.tokenize_conversations(
        tokenizer, train_convs, max_length=args.max_seq_length, max_tokens_total=args.max_tokens_total,
        report=train_report))
    heldout = list(dataset.tokenize_conversations(
        tokenizer, heldout_convs, max_length=args.max_seq_length, max_tokens_total=args.heldout_tokens,
        report=heldout_report))
    if not examples:
        raise ValueError(f"no training examples with assistant tokens in {args.data}")
    _say(f"train: {train_report.summary()}")
    _say(f"held-out: {heldout_report.summary()}")
    info["data"] = {"train": vars(train_report), "heldout": vars(heldout_report)}
    return examples, heldout


def _extract(model, examples, name: str, args):
    from tqdm import tqdm

    from ..train.features import FeatureCache, cache_dir_for, extract_features

    directory = cache_dir_for(model, examples, root=args.features_dir, chunk_tokens=args.chunk_tokens)
    total = sum(len(ex.tokens) for ex in examples)
    with tqdm(total=total, desc=f"features ({name})", unit="tok", file=sys.stderr) as bar:
        for progress in extract_features(model, examples, directory, chunk_tokens=args.chunk_tokens):
            bar.update(progress.done - bar.n)
            bar.set_postfix(chunk=f"{progress.chunk + 1}/{progress.num_chunks}",
                            tok_s=f"{progress.tokens_per_s:.0f}")
    return FeatureCache(directory)


def _train(model, train_cache, heldout_cache, output: Path, config) -> None:
    from tqdm import tqdm

    from ..train.medusa import EvalRecord, train_medusa

    bar = None
    for record in train_medusa(model, train_cache, heldout_cache, output, config):
        if isinstance(record, EvalRecord):
            if bar is not None:
                bar.close()
                bar = None
            print(_eval_line(record), flush=True)
            continue
        if bar is None:
            bar = tqdm(total=record.steps_per_epoch, initial=record.step - 1, desc=f"epoch {record.epoch + 1}",
                       unit="step", file=sys.stderr)
        bar.update(1)
        bar.set_postfix(loss=f"{record.loss:.3f}", pos_s=f"{record.positions / record.step_s:.0f}")
    if bar is not None:
        bar.close()


def _eval_line(record) -> str:
    def fmt(values):
        return " ".join(f"{v:.3f}" for v in values)

    when = "before training" if record.epoch == 0 else f"epoch {record.epoch}"
    loss = f"train loss {record.train_loss:.3f}; " if record.train_loss is not None else ""
    return (f"{when}: {loss}held-out top-1 per head: {fmt(record.accuracy)} (text), "
            f"{fmt(record.target_accuracy)} (target greedy), top-10 {fmt(record.target_top10)} "
            f"[{record.positions} positions]")


def run_measure(args: argparse.Namespace) -> int:
    """``mlxspec train measure``: the drafter table for the README."""
    from ..data import read_prompts_jsonl
    from ..loading import describe, load
    from ..train.measure import markdown_table, measure, read_plain_runs

    specs = [_contender_args(spec) for spec in (args.contender or DEFAULT_CONTENDERS)]
    prompts = read_prompts_jsonl(args.prompts)[: args.num_prompts]
    model, tokenizer = load(args.model, dtype="float32")
    unknown = set(args.replay_only) - {name for name, _ in specs}
    if unknown:
        raise ValueError(f"--replay-only names no contender: {', '.join(sorted(unknown))}")
    contenders = [_contender(name, flags, model, tokenizer, describe(args.model, model), name not in args.replay_only)
                  for name, flags in specs]
    plain_runs = read_plain_runs(args.plain_runs, max_tokens=args.max_tokens) if args.plain_runs else None
    records = []
    out = open(args.output, "w", encoding="utf-8") if args.output else None  # noqa: SIM115
    try:
        for record in measure(model, tokenizer, contenders, prompts, temps=args.temps, max_tokens=args.max_tokens,
                              seed=args.seed, engine_prompts=args.engine_prompts, plain_runs=plain_runs):
            records.append(record)
            s = record.stats
            speed = f", {s.generation_tps:.1f} tok/s" if record.mode == "engine" else ""
            _say(f"{record.prompt_id} temp {record.temp:g} {record.config} ({record.mode}): "
                 f"{s.generation_tokens} tokens, τ {s.tau:.2f}{speed}")
            if out:
                line = {"prompt_id": record.prompt_id, "config": record.config, "temp": record.temp,
                        "mode": record.mode, "stats": s.to_dict()}
                if record.tokens is not None:
                    line["tokens"] = record.tokens
                out.write(json.dumps(line) + "\n")
                out.flush()
    finally:
        if out:
            out.close()
    table = markdown_table(records)
    print(table)
    if args.output:
        Path(args.output).with_suffix(".md").write_text(table + "\n")
    return 0


def _contender_args(spec: str) -> tuple[str, argparse.Namespace]:
    """``'NAME=FLAGS'`` → (name, the flags parsed as 'mlxspec generate' parses them)."""
    from ..tree import read_tree
    from .common import add_model_args

    name, sep, flags = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--contender {spec!r}: write it as 'NAME=FLAGS', e.g. 'ngram=--drafter ngram'")
    parser = ArgumentParser(prog=f"mlxspec train measure --contender '{name}=...'")
    add_model_args(parser)
    args = parser.parse_args(shlex.split(flags))
    read_tree(args.medusa_tree)
    if args.typical_threshold is not None or args.typical_alpha is not None:
        raise ValueError(f"--contender {name!r}: typical acceptance is lossy; the table measures exact drafters only")
    if args.drafter is None or args.drafter == "none" or args.num_draft_tokens < 1:
        raise ValueError(f"--contender {name!r}: name a drafter (--drafter ...) and a γ >= 1 "
                         "(plain decoding is always measured)")
    return name.strip(), args


def _contender(name: str, args: argparse.Namespace, model, tokenizer, model_name: str, engine: bool):
    from ..train.measure import Contender
    from .common import build_drafter

    drafter, _ = build_drafter(args, model, tokenizer, model_name)
    return Contender(name, drafter, args.num_draft_tokens, engine)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
