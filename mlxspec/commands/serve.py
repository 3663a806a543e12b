"""``mlxspec serve``: an OpenAI- and Anthropic-compatible local server (the ``serve`` extra)."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import sys

from ..engine.runner import DEFAULT_MAX_BATCH
from ..runtime.distributed import rank_output
from ..sharding import refuse_unsharded, start
from .chat import exit_now
from .common import (
    ArgumentParser,
    add_blas_arg,
    add_model_args,
    add_sampling_args,
    add_shard_arg,
    check_args,
    load_models,
    measuring_note,
    run_main,
    sampling_from_args,
)

#: Most tokens of an answer when a request names none.
DEFAULT_MAX_TOKENS = 2048
#: Packages of the ``serve`` extra.
SERVE_PACKAGES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mlxspec serve",
        description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) "
        "and the Anthropic Messages API (/v1/messages) with lossless speculative decoding. Up to --max-batch "
        "requests decode together; the others wait in a bounded queue (docs/serve.md).",
    )
    add_model_args(parser, allow_auto=True)
    add_sampling_args(parser, max_tokens=DEFAULT_MAX_TOKENS,
                      max_tokens_help="most tokens of an answer when a request names none (max_tokens)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; anything but loopback should come with --api-key. Default: 127.0.0.1",
    )
    parser.add_argument("--port", type=int, default=8080, help="port to listen on. Default: 8080")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require this key ('Authorization: Bearer KEY' or 'x-api-key: KEY'). Default: none",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="most requests decoding together, each speculating exactly in one batched forward "
        f"(1: one at a time). Default: {DEFAULT_MAX_BATCH}",
    )
    parser.add_argument("--queue-size", type=int, default=16,
                        help="most requests waiting behind the running ones; more get 503 with Retry-After. "
                             "Default: 16")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take, queueing included; then its answer ends as at max_tokens. Default: "
        "600",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds the rest of a request body may take to arrive before the request gets 408 (a client "
        "that sent half a request and hangs). Default: 30",
    )
    parser.add_argument(
        "--prefix-cache-slots",
        type=int,
        default=4,
        help="KV caches kept between requests (conversations, agents) to reuse their prefix. Default: 4",
    )
    parser.add_argument("--prefix-cache-gb", type=float, default=2.0,
                        help="most GB those caches may hold together. Default: 2")
    add_blas_arg(parser)
    add_shard_arg(parser, "rank 0 serves HTTP and the other ranks run each request with it")
    return parser


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse bad server flags before anything loads; warn about a non-local address without a key.

    Raises:
        ValueError: naming the flag, or the missing ``serve`` extra.
    """
    check_args(args)
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    minimums = (("--queue-size", args.queue_size, 1), ("--prefix-cache-slots", args.prefix_cache_slots, 1),
                ("--max-batch", args.max_batch, 1))
    for flag, value, low in minimums:
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not args.body_timeout > 0:
        raise ValueError(f"--body-timeout must be > 0 seconds, got {args.body_timeout}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not args.prefix_cache_gb >= 0:
        raise ValueError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    if args.api_key == "":
        raise ValueError("--api-key is empty; give a key, or leave --api-key out")
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"mlxspec serve needs the serve extra ({', '.join(missing)} missing): "
                         "pip install 'mlxspec[serve]'")
    if not args.api_key and not _loopback(args.host):
        print(
            f"mlxspec serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
            "machine can use the model",
            file=sys.stderr,
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loader(args: argparse.Namespace, num_draft_tokens: int | str | None = None):
    """The worker's ``load``: target, drafter and γ policy from the flags (``mlxspec generate``'s); γ is
    ``num_draft_tokens`` where given (a sharded job's fixed one, ``sharding.start``), else the flag's."""
    gamma = args.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    from ..engine.generate import context_length
    from ..engine.session import check_fits
    from ..pacing import make_pacer
    from ..serve.worker import Served

    def load():
        loaded = load_models(args, on_measure=measuring_note("the automatic tree size"))
        check_fits(loaded.target, loaded.drafter)
        policy = make_pacer(gamma, loaded.model, loaded.drafter,
                            on_measure=measuring_note(f"--num-draft-tokens {gamma}"))
        tokenizer = loaded.tokenizer
        served = Served(loaded.target.name, tokenizer, context_length(loaded.model), loaded.drafter.name,
                        frozenset(tokenizer.eos_token_ids))
        return loaded.model, tokenizer, loaded.drafter, policy, served

    return load


def run(args: argparse.Namespace) -> int:
    check_serve_args(args)
    from ..serve.jobs import Defaults
    from ..serve.server import follow, serve

    defaults = Defaults(sampling_from_args(args), args.max_tokens, args.seed, tuple(args.stop or ()))
    if not args.shard:
        refuse_unsharded("serve")  # under mlx.launch: said once, by rank 0
        status = serve(args, defaults, loader(args))
    else:
        # a seed per request
        job = start(args.shard, args.model, args.num_draft_tokens, args.seed, same_seed=False)
        load = loader(args, job.num_draft_tokens)
        with rank_output(job.rank):  # rank 0 prints; the others print only error lines
            try:
                status = serve(args, defaults, load) if job.rank == 0 else follow(args, load)
            # stopped by mlx.launch (rank_output): the worker thread may be inside MLX
            except SystemExit as e:
                status = e.code
    # MLX's stream threads may still be winding down: skip the C++ destructors (as chat does)
    exit_now(status)


def main(argv: list[str] | None = None, *, entry: bool = False) -> int:
    """Run ``mlxspec serve``; returns the exit status (0 after SIGINT/SIGTERM, 2 on a user error)."""
    return run_main("serve", setup_arg_parser(), run, argv, entry=entry, fast_blas=True)
