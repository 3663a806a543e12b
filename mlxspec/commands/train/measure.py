"""``mlxspec train measure``: τ, acceptance and tokens/s of drafters on held-out prompts, as a Markdown table.

Each ``--contender`` is a drafter configuration written as ``mlxspec generate`` flags; plain decoding is
always measured beside them (``mlxspec.train.measure``).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from ...loading.data import read_prompts_jsonl
from ...engine.session import ModelSpec, load_model
from ...train.measure import Contender, markdown_table, measure, read_plain_runs
from ..common import ArgumentParser, add_model_args, build_drafter, check_drafter_args
from .shared import HELDOUT_PROMPTS, say

HELP = "τ, acceptance and tokens/s of drafters on held-out prompts"
DESCRIPTION = ("Run prompts with plain decoding and each drafter configuration (float32 target); "
               "print a Markdown table.")
DEFAULT_CONTENDERS = ["ngram=--drafter ngram --num-draft-tokens 4",
                      "medusa chain_4=--drafter medusa --medusa-tree chain_4 --num-draft-tokens 4",
                      "medusa small_15=--drafter medusa --medusa-tree small_15 --num-draft-tokens 4"]


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train measure`` flags."""
    p.add_argument("--model", default="default",
                   help="target (any spec 'mlxspec generate' takes); loaded in float32. Default: default")
    p.add_argument("--contender", "-c", action="append", default=None, metavar="'NAME=FLAGS'",
                   help="a drafter configuration as 'mlxspec generate' flags, e.g. 'medusa "
                        "small_15=--drafter medusa --medusa-tree small_15 --num-draft-tokens 4'; "
                        "repeat for each. Default: " + "; ".join(DEFAULT_CONTENDERS))
    p.add_argument("--prompts", required=True,
                   help=f'JSONL of {{"prompt": ...}} lines, e.g. the {HELDOUT_PROMPTS} written by training')
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts. Default: all")
    p.add_argument("--temps", nargs="+", type=float, default=[0.0, 0.7],
                   help="sampling temperatures. Default: 0 0.7")
    p.add_argument("--max-tokens", "-m", type=int, default=128, help="new tokens per run. Default: 128")
    p.add_argument("--seed", type=int, default=0, help="prompt i is run with seed SEED + i. Default: 0")
    p.add_argument(
        "--engine-prompts",
        type=int,
        default=None,
        help="generate with the drafters (for tokens/s) on the first N prompts only; τ and acceptance are "
        "replayed from the plain runs on every prompt. Default: all",
    )
    p.add_argument("--replay-only", nargs="+", default=[], metavar="NAME",
                   help="contenders to replay but never time (e.g. trees too wide for this machine)")
    p.add_argument(
        "--plain-runs",
        default=None,
        metavar="JSONL",
        help="reuse the plain runs (their tokens) of an earlier --output of the same prompts, temperatures, "
        "--max-tokens and --seed instead of generating them again: replaying new drafters then costs one "
        "target forward per prompt (prompts with engine runs still get a fresh plain run, for a fair "
        "speed-up). Default: generate them",
    )
    p.add_argument("--output", "-o", default=None,
                   help="write every run as JSONL here and the table beside it (.md). Default: print only")


def run(args: argparse.Namespace) -> int:
    """``mlxspec train measure``: the drafter table for the README."""
    specs = [_contender_args(spec) for spec in (args.contender or DEFAULT_CONTENDERS)]
    prompts = read_prompts_jsonl(args.prompts)[: args.num_prompts]
    target = load_model(ModelSpec(args.model, "float32"))
    model, tokenizer = target.model, target.tokenizer
    unknown = set(args.replay_only) - {name for name, _ in specs}
    if unknown:
        raise ValueError(f"--replay-only names no contender: {', '.join(sorted(unknown))}")
    contenders = [_contender(name, flags, target, name not in args.replay_only) for name, flags in specs]
    plain_runs = read_plain_runs(args.plain_runs, max_tokens=args.max_tokens) if args.plain_runs else None
    records = []
    out = open(args.output, "w", encoding="utf-8") if args.output else None  # noqa: SIM115
    try:
        for record in measure(model, tokenizer, contenders, prompts, temps=args.temps,
                              max_tokens=args.max_tokens, seed=args.seed, engine_prompts=args.engine_prompts,
                              plain_runs=plain_runs):
            records.append(record)
            s = record.stats
            speed = f", {s.generation_tps:.1f} tok/s" if record.mode == "engine" else ""
            say(f"{record.prompt_id} temp {record.temp:g} {record.config} ({record.mode}): "
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
    name, sep, flags = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--contender {spec!r}: write it as 'NAME=FLAGS', e.g. 'ngram=--drafter ngram'")
    parser = ArgumentParser(prog=f"mlxspec train measure --contender '{name}=...'")
    add_model_args(parser)
    args = parser.parse_args(shlex.split(flags))
    check_drafter_args(args)
    if args.typical_threshold is not None or args.typical_alpha is not None:
        raise ValueError(
            f"--contender {name!r}: typical acceptance is lossy; the table measures exact drafters only"
        )
    if args.drafter is None or args.drafter.kind.plain or args.num_draft_tokens < 1:
        raise ValueError(f"--contender {name!r}: name a drafter (--drafter ...) and a γ >= 1 "
                         "(plain decoding is always measured)")
    return name.strip(), args


def _contender(name: str, args: argparse.Namespace, target, engine: bool):
    drafter, _ = build_drafter(args, target)
    return Contender(name, drafter, args.num_draft_tokens, engine)
