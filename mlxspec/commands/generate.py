"""``mlxspec generate``: stream one answer with speculative decoding, then its stats."""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx

from ..pacing import AUTO, SCHEDULED, load_or_calibrate, make_pacer, tree_summary
from ..drafters import drafter_types, make_drafter
from ..runtime.distributed import job_sum, rank_output
from ..sharding import refuse_unsharded, start
from ..engine.generate import check_context, context_length, encode_prompt, stream_generate
from ..engine.session import check_fits
from ..core.metrics import GenerationStats, TokenEvent
from .common import (
    ArgumentParser,
    add_model_args,
    add_sampling_args,
    check_args,
    add_blas_arg,
    add_recalibrate_arg,
    add_shard_arg,
    run_main,
    load_models,
    measuring_note,
    sampling_from_args,
    typical_from_args,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mlxspec generate",
        description="Generate text with lossless speculative decoding (output distributed exactly as the "
        "target's).",
    )
    add_model_args(parser, allow_auto=True)
    parser.add_argument("--prompt", "-p", default=None,
                        help="the prompt; '-' or omitted reads it from standard input")
    parser.add_argument("--system", default=None, help="system prompt for the chat template")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="feed the prompt as raw text instead of through the chat template")
    add_sampling_args(parser)
    add_recalibrate_arg(parser)
    add_blas_arg(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON record (text and every stat) instead of streaming")
    add_shard_arg(parser, "only rank 0 prints")
    return parser


def build_prompt(tokenizer, prompt: str, system: str | None, use_chat_template: bool) -> str | list[int]:
    """The chat-templated prompt ids, or the raw text when there is no template or it is turned off."""
    if not use_chat_template or not tokenizer.has_chat_template:
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def format_stats(stats: GenerationStats, drafter=None, policy: str = AUTO) -> str:
    """The human-readable stats block printed after the answer.

    Args:
        stats: The run's totals.
        drafter: The drafter used; a tree drafter's line names its tree and size, and α is
            explained (it counts every drafted node, of which at most one path can be kept).
        policy: ``--num-draft-tokens``'s word for an adaptive γ (``auto`` or ``scheduled``).
    """
    per_position = " ".join(f"{rate:.2f}" for rate in stats.acceptance_per_position) or "-"
    tree = shape = tree_summary(drafter) if drafter is not None else None
    plain = drafter.profile.plain if drafter is not None else _declared_plain(stats.drafter)
    nothing = stats.rounds and not stats.drafted and not plain and stats.num_draft_tokens
    if nothing:  # no γ: a lookup that found nothing, auto falling back, or a tree of which no node paid
        tree = f"{tree}; drafted 0" if tree else "drafted 0"
    elif tree and stats.gamma_rounds:  # γ auto chose each round's depth
        tree += f"; depth γ = {_gamma_summary(stats, policy)}"
    elif tree and 0 < stats.num_draft_tokens < (drafter.profile.max_depth or 0):
        tree += f", cut to depth {stats.num_draft_tokens} by γ"  # a fixed γ below the tree's own depth
    vocabulary = drafter.vocab_summary() if drafter is not None else None
    name = stats.drafter + (f" ({vocabulary})" if vocabulary else "")
    drafter_line = (f"Drafter: {name}, {tree}; rounds: {stats.rounds}" if tree else
                    f"Drafter: {name}, γ = {_gamma_summary(stats, policy)}; rounds: {stats.rounds}")
    alpha = f"{stats.alpha:.3f}" if stats.drafted else "–"
    lines = [
        "=" * 10,
        f"Prompt: {stats.prompt_tokens} tokens"
        + (f", {stats.cached_tokens} reused from the cache" if stats.cached_tokens else "")
        + (f", {stats.prompt_tps:.1f} tokens/s" if stats.prompt_tps else ""),
        f"Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.1f} tokens/s (finish: "
        f"{stats.finish_reason})",
        drafter_line,
        f"Acceptance: α = {alpha}, τ = {stats.tau:.2f} tokens/round",
        f"Acceptance per {'depth' if shape else 'draft position'}: {per_position}",
        f"Time: draft {stats.draft_s:.2f} s, verify {stats.verify_s:.2f} s",
        f"Peak memory: {stats.peak_memory_gb:.3f} GB",
    ]
    if tree and stats.drafted:
        lines.insert(
            5,
            "  (a tree: α = accepted / all drafted nodes, and at most one path of them can be kept; τ and "
            "acceptance per depth say how far the kept path reached)",
        )
    return "\n".join(lines)


def _declared_plain(name: str) -> bool:
    """Whether the registered drafter ``name`` declares plain decoding (an unregistered name does not)."""
    kind = drafter_types().get(name)
    return kind is not None and kind.plain


def _gamma_summary(stats: GenerationStats, policy: str) -> str:
    """``4``, or for auto / scheduled γ the mean choice and how often it fell back to plain decoding."""
    if not stats.gamma_rounds:
        return str(stats.num_draft_tokens)
    rounds = sum(stats.gamma_rounds)
    mean = sum(g * n for g, n in enumerate(stats.gamma_rounds)) / rounds if rounds else 0.0
    text = f"{policy} (mean {mean:.1f}, at most {stats.num_draft_tokens})"
    if stats.plain_fallback_rounds:
        text += f"; fell back to plain decoding in {stats.plain_fallback_rounds} of {rounds} rounds"
    return text


def read_prompt(args) -> str:
    """The prompt text from ``--prompt`` or standard input.

    Raises:
        ValueError: no prompt, a closed standard input, text that is not UTF-8, or only whitespace.
    """
    if args.prompt is not None and args.prompt != "-":
        text = args.prompt
    elif sys.stdin is None or sys.stdin.closed:
        raise ValueError("no prompt: standard input is closed; pass --prompt TEXT")
    elif args.prompt is None and sys.stdin.isatty():
        raise ValueError("no prompt: pass --prompt TEXT or pipe it on standard input")
    else:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"the prompt on standard input is not UTF-8 text (byte {e.start}); "
                             "convert it, e.g. with iconv -t utf-8") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in argv arrive as surrogates
        raise ValueError("the prompt is not valid UTF-8 text; pass it as UTF-8") from None
    if not text.strip():
        raise ValueError("the prompt is empty; give some text with --prompt or on standard input")
    return text


def _note_context_cap(model, tokenizer, prompt, max_tokens: int) -> None:
    """Say on stderr when the model's context cuts the answer shorter than --max-tokens."""
    limit = context_length(model)
    num = len(encode_prompt(tokenizer, prompt))
    if limit and num < limit < num + max_tokens:
        print(f"mlxspec: note: the model's context is {limit} tokens, so the answer stops after "
              f"{limit - num} (the prompt has {num})", file=sys.stderr)


def _plain_if_unfit(args, loaded) -> None:
    """Before any cost measurement: a drafter the target's cache cannot serve (a recurrent model's state
    cannot be rewound) is refused in one line when asked for; the default one is replaced by plain decoding,
    said once."""
    if loaded.drafter.profile.plain or args.num_draft_tokens == 0:
        return
    try:
        check_fits(loaded.target, loaded.drafter)
    except ValueError as error:
        if args.drafter is not None or args.draft_model:
            raise
        print(f"mlxspec: note: {error}; decoding plainly", file=sys.stderr)
        loaded.drafter = make_drafter("none")


def _note_quantized_on_cpu(target) -> None:
    """Say on stderr when a quantized target runs on MLX's CPU backend, which has no fast kernels for
    quantized weights (docs/linux.md): there ``--dtype float32`` is the faster choice, drafting or not."""
    if target.quantized and mx.default_device().type == mx.cpu:
        print(
            "mlxspec: note: the target is quantized and MLX runs on the CPU here, which has no fast kernels "
            "for quantized weights: --dtype float32 is faster (docs/linux.md)",
            file=sys.stderr,
        )


def _interrupted(num_tokens: int, json_record: bool) -> int:
    """Ctrl+C mid-answer: end the streamed line, say so in one line on stderr; exit status 130 (128 +
    SIGINT)."""
    if json_record:
        where = "--json prints no record of an interrupted answer"
    else:
        print(flush=True)
        where = "the partial answer is on standard output"
    print(f"mlxspec: interrupted (Ctrl+C) after {num_tokens} generated tokens; {where}", file=sys.stderr)
    return 130


def _noting(stage: list[str], why: str, quiet: bool):
    """An ``on_measure`` that records what is being measured in ``stage[0]`` (for Ctrl+C) and, unless
    ``quiet``, says it on stderr (``measuring_note``)."""
    say = None if quiet else measuring_note(why)

    def note(what: str) -> None:
        stage[0] = f"measuring {what} on this machine"
        if say is not None:
            say(what)

    return note


def _prepare(args: argparse.Namespace, stage: list[str], gamma: int | str):
    """Prompt, models and the γ policy for ``gamma`` (the flag's, or a sharded job's fixed one); ``stage[0]``
    says what is under way, for a Ctrl+C."""
    prompt_text = read_prompt(args)
    stage[0] = "loading the models"
    loaded = load_models(args, on_measure=_noting(stage, "the automatic tree size", args.json))
    _note_quantized_on_cpu(loaded.target)
    stage[0] = "preparing to generate"  # a cost measurement below names itself
    prompt = build_prompt(loaded.tokenizer, prompt_text, args.system, not args.no_chat_template)
    _note_context_cap(loaded.model, loaded.tokenizer, prompt, args.max_tokens)
    check_context(loaded.model, len(encode_prompt(loaded.tokenizer, prompt)))  # before any cost measurement
    _plain_if_unfit(args, loaded)
    note = _noting(stage, f"--num-draft-tokens {gamma}", args.json)
    costs = None
    if args.recalibrate and gamma in (AUTO, SCHEDULED) and not loaded.drafter.profile.plain:
        costs = load_or_calibrate(loaded.model, loaded.drafter, refresh=True, on_measure=note)
    policy = make_pacer(gamma, loaded.model, loaded.drafter, costs=costs, on_measure=note)
    return loaded, prompt, policy


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if not args.shard:
        refuse_unsharded("generate")  # under mlx.launch: said once, by rank 0
        return _run(args, args.num_draft_tokens, args.seed)
    job = start(args.shard, args.model, args.num_draft_tokens, args.seed)  # refuses, once, what cannot work
    with rank_output(job.rank):  # only rank 0 prints
        return _run(args, job.num_draft_tokens, job.seed)


def _run(args: argparse.Namespace, gamma: int | str, seed: int | None) -> int:
    """Generate with γ ``gamma`` and ``seed`` (the flags', or a sharded job's: ``sharding.start``)."""
    stage = ["reading the prompt"]
    try:
        loaded, prompt, policy = _prepare(args, stage, gamma)
    except KeyboardInterrupt:  # one line, as mid-answer; nothing is on stdout yet
        print(f"mlxspec: interrupted (Ctrl+C) while {stage[0]}; nothing was generated", file=sys.stderr)
        return 130
    typical = typical_from_args(args)
    events = stream_generate(
        loaded.model, loaded.tokenizer, prompt, drafter=loaded.drafter, num_draft_tokens=policy,
        max_tokens=args.max_tokens, sampling=sampling_from_args(args), seed=seed, typical=typical,
        stop=args.stop,
    )
    text = []
    try:
        for event in events:
            if isinstance(event, TokenEvent):
                text.append(event.text)
                if not args.json:
                    print(event.text, end="", flush=True)
            elif isinstance(event, GenerationStats):
                stats = event
    except KeyboardInterrupt:
        events.close()  # its finally leaves the caches at what was committed
        return _interrupted(len(text), args.json)
    stats.peak_memory_gb = job_sum(loaded.model, stats.peak_memory_gb)  # the whole job's memory
    if args.json:
        record = {
            "model": loaded.target.display,
            "draft_model": loaded.draft.display if loaded.draft else None,
            "text": "".join(text),
            "num_draft_tokens_requested": args.num_draft_tokens,
            "temp": args.temp,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "typical": typical,
            "seed": seed,
            "stop": args.stop,
            **stats.to_dict(),
        }
        print(json.dumps(record))
    else:
        print()
        print(format_stats(stats, loaded.drafter, str(gamma)), file=sys.stderr)
        if typical:
            print(
                "Verification: Medusa typical acceptance (LOSSY: not distributed as the target)",
                file=sys.stderr,
            )
    return 0


def main(argv: list[str] | None = None, *, entry: bool = False) -> int:
    """Run ``mlxspec generate``; returns the exit status (2 on a user error). ``entry``: see ``run_main``."""
    return run_main("generate", setup_arg_parser(), run, argv, entry=entry, fast_blas=True)
