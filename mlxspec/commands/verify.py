"""``mlxspec verify``: check that speculation samples exactly as the target, on your own model and drafter."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from ..pacing import load_or_calibrate, make_pacer
from ..engine.generate import DEFAULT_NUM_DRAFT_TOKENS, encode_prompt
from ..bench.verify_check import (
    DEFAULT_ALPHA,
    DEFAULT_PROMPTS,
    DEFAULT_SAMPLES,
    DEFAULT_TOKENS,
    MAX_TOKENS,
    VerifyReport,
    check_num_tokens,
    run_check,
)
from .common import (
    ArgumentParser,
    add_blas_arg,
    add_model_args,
    add_recalibrate_arg,
    add_sampling_args,
    check_args,
)
from .common import load_models
from .common import measuring_note, run_main
from .common import sampling_from_args, typical_from_args
from .generate import build_prompt


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mlxspec verify",
        description="Sample the first --tokens tokens --samples times with speculative decoding and test "
        "them against the target's exact distribution (G-test, Holm-corrected over prompts); at --temp 0, "
        "compare --max-tokens tokens with plain greedy decoding. Exit status 0 = PASS, 1 = FAIL.",
    )
    add_model_args(parser, allow_auto=True, default_gamma=DEFAULT_NUM_DRAFT_TOKENS)
    add_recalibrate_arg(parser)
    # γ auto's costs are this BLAS's: the policy generate runs, with the BLAS generate uses
    add_blas_arg(parser)
    parser.add_argument(
        "--prompts",
        default=None,
        help="a text file with one prompt per line ('-' reads standard input). Default: three built-in "
        "prompts",
    )
    parser.add_argument("--no-chat-template", action="store_true",
                        help="feed the prompts as raw text instead of through the chat template")
    parser.add_argument("--samples", "-n", type=int, default=DEFAULT_SAMPLES,
                        help=f"sequences sampled per prompt at --temp > 0. Default: {DEFAULT_SAMPLES}")
    parser.add_argument(
        "--tokens",
        "-k",
        type=int,
        default=DEFAULT_TOKENS,
        help=f"tokens per sampled sequence (K), 1 to {MAX_TOKENS} (a longer prefix is almost never shared by "
        f"enough samples to be tested). Default: {DEFAULT_TOKENS}",
    )
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help=f"family-wise significance level over the prompts. Default: {DEFAULT_ALPHA}")
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="run the same check with a deliberately broken acceptance rule (resampling from p instead of "
        "the residual; at --temp 0, accepting every draft): it should FAIL, which shows the check has power. "
        "Exit status 0 when it does",
    )
    parser.add_argument(
        "--no-batch",
        action="store_true",
        help="run every sample through the engine's round loop even when samples could share work",
    )
    add_sampling_args(
        parser, max_tokens=64, max_tokens_help="at --temp 0: tokens compared with plain greedy decoding"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON record instead of the table")
    return parser


def _prompts(args) -> list[str]:
    if args.prompts is None:
        return list(DEFAULT_PROMPTS)
    if not args.prompts:
        raise ValueError(
            "--prompts is empty; name a text file with one prompt per line, or - for standard input"
        )
    path = Path(args.prompts)
    if args.prompts == "-":
        data = sys.stdin.buffer.read() if sys.stdin is not None and not sys.stdin.closed else b""
    elif not path.exists() or path.is_dir():  # a pipe such as <(...) or /dev/stdin is read as a file
        raise ValueError(f"--prompts: {path} is not a file; give a text file with one prompt per line")
    else:
        data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Windows editors) is not part of the first prompt
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--prompts: {path} is not UTF-8 text (byte {e.start}); convert it, e.g. with iconv -t utf-8"
        ) from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts: {path} holds no prompt; write one prompt per line")
    return prompts


def format_report(report: VerifyReport, greedy: bool) -> str:
    """The table printed after the check: one line per prompt and the verdict."""
    lines = []
    for check in report.checks:
        verdict = "PASS" if check.passed else "FAIL"
        drafted = f"drafted {check.drafted}, accepted {check.accepted}"
        if greedy:
            where = (
                "identical to plain greedy"
                if check.mismatch_at is None
                else f"differs at token {check.mismatch_at}"
            )
            lines.append(f"{verdict}  {where}; {drafted}  {check.prompt[:50]!r}")
        else:
            lines.append(
                f"{verdict}  G = {check.statistic:8.1f}  df = {check.df:4d}  p = {check.p_value:.3g}  Holm p "
                f"= {check.adjusted_p:.3g}  ({check.prefixes_tested} prefixes; {drafted})  "
                f"{check.prompt[:50]!r}"
            )
    nothing = all(c.drafted == 0 for c in report.checks)
    overall = "PASS" if report.passed else "FAIL"
    lines.append(
        f"{overall}: {sum(c.passed for c in report.checks)}/{len(report.checks)} prompts pass at alpha = "
        f"{report.alpha}"
        + (" (nothing was drafted, so speculation was not tested)" if nothing else "")
    )
    if report.self_test:
        lines.append(
            "self-test: the broken rule was "
            + (
                "detected (FAIL): the check has power here"
                if not report.passed
                else "NOT detected: use more --samples or prompts the drafter drafts well on"
            )
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.tokens < 1:  # run_check checks it only at --temp > 0, where it is used
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    if args.temp > 0:  # before loading anything
        check_num_tokens(args.tokens)
    prompt_texts = _prompts(args)
    sampling = sampling_from_args(args)
    loaded = load_models(args)
    prompts = [
        (
            text,
            encode_prompt(
                loaded.tokenizer, build_prompt(loaded.tokenizer, text, None, not args.no_chat_template)
            ),
        )
        for text in prompt_texts
    ]
    gamma = args.num_draft_tokens
    # auto / scheduled: the policy generate runs, learning across samples and prompts
    if isinstance(gamma, str):
        say = measuring_note(f"--num-draft-tokens {gamma}")
        costs = (load_or_calibrate(loaded.model, loaded.drafter, refresh=True, on_measure=say)
                 if args.recalibrate and not loaded.drafter.profile.plain else None)
        gamma = make_pacer(gamma, loaded.model, loaded.drafter, costs=costs, on_measure=say)
    total = len(prompts) * (1 if sampling.greedy else args.samples)
    with tqdm(total=total, unit="prompt" if sampling.greedy else "sample", disable=None, file=sys.stderr,
              desc=f"verify {loaded.drafter.name}") as bar:
        report = run_check(
            loaded.model,
            prompts,
            loaded.drafter,
            sampling,
            num_tokens=args.max_tokens if sampling.greedy else args.tokens,
            num_samples=args.samples,
            num_draft_tokens=gamma,
            alpha=args.alpha,
            self_test=args.self_test,
            typical=typical_from_args(args),
            seed=args.seed if args.seed is not None else 0,
            batch=not args.no_batch,
            progress=bar.update,
        )
    if args.json:
        record = {
            "model": loaded.target.display,
            "drafter": loaded.drafter.name,
            "temp": args.temp,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "samples": args.samples,
            "num_draft_tokens": args.num_draft_tokens,
            "seed": args.seed if args.seed is not None else 0,
            "tokens": args.max_tokens if sampling.greedy else args.tokens,
            **report.to_dict(),
        }
        print(json.dumps(record))
    else:
        print(format_report(report, sampling.greedy))
    return 0 if report.passed != args.self_test else 1


def main(argv: list[str] | None = None, *, entry: bool = False) -> int:
    """Run ``mlxspec verify``; returns 0 (PASS; with ``--self-test``: the broken rule FAILed), 1, or 2 on a
    user error."""
    return run_main("verify", setup_arg_parser(), run, argv, entry=entry, fast_blas=True)
