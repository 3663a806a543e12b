"""``mlxspec chat``: the terminal chat that shows speculation as it happens (Textual app in ``app/``)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from ..loading.assets import NAMED_MODELS, named_model_path
from ..pacing import AUTO
from ..engine.session import draft_model_spec
from ..runtime.distributed import refuse_launched
from .common import (
    ArgumentParser,
    add_model_args,
    add_sampling_args,
    check_args,
    drafter_spec_from_args,
    add_blas_arg,
    add_recalibrate_arg,
    run_main,
    model_spec,
    sampling_from_args,
    typical_from_args,
)

#: γ of the chat unless --num-draft-tokens says otherwise: auto, which falls back to plain decoding
#: when speculation would lose on this machine (a fixed γ can be slower than plain).
DEFAULT_NUM_DRAFT_TOKENS = AUTO


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mlxspec chat",
        description="Chat in the terminal with lossless speculative decoding: accepted draft tokens green, "
        "resampled tokens underlined (red with F4 or --vivid), live τ and α. F1 in the app lists the keys.",
    )
    add_model_args(parser, allow_auto=True, default_gamma=DEFAULT_NUM_DRAFT_TOKENS)
    parser.add_argument("--system", default=None, help="system prompt put before the conversation")
    parser.add_argument(
        "--vivid",
        action="store_true",
        help="paint resampled tokens red from the start (the default underlines them; F4 swaps)",
    )
    add_sampling_args(parser)
    add_recalibrate_arg(parser)
    add_blas_arg(parser)
    return parser


def engine_config(args: argparse.Namespace):
    """The engine's settings from the parsed flags (raises ``ValueError`` on bad sampling flags)."""
    from mlxspec_app.engine import EngineConfig

    return EngineConfig(
        model=model_spec(args),
        draft_model=model_spec(args, draft=True),
        drafter=drafter_spec_from_args(args),
        num_draft_tokens=args.num_draft_tokens,
        sampling=sampling_from_args(args),
        max_tokens=args.max_tokens,
        seed=args.seed,
        typical=typical_from_args(args),
        draft_dtype=args.draft_dtype,
        stop=tuple(args.stop or ()),
        recalibrate=args.recalibrate,
    )


def checked_config(args: argparse.Namespace):
    """``engine_config`` after the checks ``mlxspec generate`` makes; ``--drafter draft`` without
    ``--draft-model`` takes the draft shipped for the target. Raises ``ValueError`` on bad flags."""
    check_args(args, one_drafter=False)
    config = engine_config(args)
    draft = draft_model_spec(config.drafter, config.draft_model, config.model, args.draft_dtype)
    return replace(config, draft_model=draft)


def fetch_named_models(args: argparse.Namespace) -> None:
    """Fetch named models (``default``, ``qwen2.5-coder-1.5b``, ...) before the app takes the terminal,
    so the download's progress shows on stderr instead of garbling the app (first run only)."""
    for spec in (args.model, args.draft_model):
        if spec in NAMED_MODELS:
            named_model_path(spec)  # says on stderr what it downloads, once


def run(args: argparse.Namespace) -> int:
    """Check the flags, fetch named models, then run the app until it quits (the process ends there)."""
    refuse_launched(
        "chat",
        "every rank would start the terminal app",
        "for a sharded target run 'mlxspec serve --shard tensor' under mlx.launch and chat through any "
        "OpenAI or Anthropic client, or use 'mlxspec generate --shard tensor'",
    )
    config = checked_config(args)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ValueError("mlxspec chat needs a terminal; to answer from a script use 'mlxspec generate'")
    fetch_named_models(args)
    from mlxspec_app.app import SpecChatApp
    from mlxspec_app.engine import Engine

    engine = Engine(config)
    SpecChatApp(engine, system=args.system, vivid=args.vivid).run()  # closes the engine when it exits
    exit_now(0)


def main(argv: list[str] | None = None, *, entry: bool = False) -> int:
    """Run ``mlxspec chat``; returns the exit status (2 on a user error)."""
    return run_main("chat", setup_arg_parser(), run, argv, entry=entry, fast_blas=True)


def exit_now(status: int) -> None:
    """End the process without running C++ static destructors: MLX's stream threads may still be
    winding down after an answer stopped mid-round, and destroying them then aborts the process
    ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
