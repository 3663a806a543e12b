"""Flags and set-up shared by ``mlxspec generate`` and ``mlxspec chat``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.arguments import check_typical
from ..loading.assets import NAMED_MODELS
from ..drafters import Drafter, DrafterSpec, drafter_types
from ..runtime.machine import blas_in_use, find_fast_blas
from ..pacing import AUTO, MAX_NUM_DRAFT_TOKENS, SCHEDULED, check_num_draft_tokens
from ..engine.generate import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS
from ..loading.models import DTYPES
from ..core.sampling import SamplingParams
from ..core.stops import check_stops
from ..runtime.distributed import sharding
from ..sharding import SHARD_KINDS, check_drafter, together
from ..engine.session import (
    USER_ERRORS,
    LoadedModel,
    ModelSpec,
    default_drafter,
    draft_model_spec,
    load_model,
)
from ..engine.session import build_drafter as session_build_drafter


__all__ = [
    "USER_ERRORS",
    "ArgumentParser",
    "LoadedModels",
    "add_drafter_args",
    "add_drafter_option_args",
    "add_model_args",
    "add_sampling_args",
    "build_drafter",
    "check_args",
    "check_drafter_args",
    "drafter_spec_from_args",
    "drafter_flags_given",
    "with_drafter_flags",
    "fail",
    "load_models",
    "measuring_note",
    "model_spec",
    "num_draft_tokens_arg",
    "run_main",
    "sampling_from_args",
    "seed_arg",
    "typical_from_args",
    "add_blas_arg",
    "add_recalibrate_arg",
    "use_fast_blas",
]

#: Set in a re-executed process so it does not re-execute again.
REEXEC_ENV = "MLXSPEC_BLAS_REEXEC"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with mlxspec's one-line errors: ``mlxspec: error: ...; run '<prog> --help'``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"mlxspec: error: {message}; run '{self.prog} --help'\n")


def seed_arg(value: str) -> int:
    """``--seed``: an integer in [0, 2**64)."""
    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if not 0 <= seed < 2**64:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64), got {seed}")
    return seed


def stop_arg(value: str) -> str:
    """``--stop``: non-empty text (``stops.check_stops`` refuses an empty one too, without naming the
    flag)."""
    if not value:
        raise argparse.ArgumentTypeError("the stop text is empty; give the text that ends the answer "
                                         "(e.g. --stop '###') or leave --stop out")
    return value


def num_draft_tokens_arg(value: str) -> int | str:
    """``--num-draft-tokens``: an integer, ``auto`` or ``scheduled`` (``pacing.make_pacer``)."""
    if value in (AUTO, SCHEDULED):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, 'auto' or 'scheduled', got {value!r}"
        ) from None


class DrafterAction(argparse.Action):
    """``--drafter``: stores the parsed spec, and as ``drafter_keys`` the option keys its text set itself (a
    key its own flag sets to another value is then a conflict: ``with_drafter_flags``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            spec = DrafterSpec.parse(values)
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        _, _, rest = values.partition(":")
        keys = {item.partition("=")[0].strip().replace("-", "_") for item in rest.split(",") if item.strip()}
        setattr(namespace, self.dest, spec)
        namespace.drafter_keys = {key: values for key in keys}


def _flag_type(parse):
    def convert(value: str):
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """``--drafter`` and one flag per option of every registered drafter, generated from its options
    dataclass: field ``top_k`` of ``eagle`` is ``--eagle-top-k`` (each default is the dataclass's)."""
    kinds = drafter_types()
    parser.add_argument(
        "--drafter",
        action=DrafterAction,
        default=None,
        metavar="{" + ",".join(kinds) + "}[:K=V,...]",
        help="how tokens are proposed: "
        + "; ".join(f"{k.name}: {k.summary}" for k in kinds.values())
        + ". A spec such as 'eagle:depth=4,top_k=1' sets options too. "
        "Default: draft with --draft-model, else ngram",
    )
    add_drafter_option_args(parser)


def add_drafter_option_args(parser: argparse.ArgumentParser) -> None:
    """One flag per option of every registered drafter (``--eagle-heads``, ``--medusa-tree``, ...), each
    defaulting to ``None`` (the dataclass's default applies)."""
    for kind in drafter_types().values():
        for f in dataclasses.fields(kind.options):
            default = f.metadata["default_help"] or f.default
            parser.add_argument(f"--{kind.name}-{f.name.replace('_', '-')}", dest=f"{kind.name}_{f.name}",
                                type=_flag_type(f.metadata["parse"]), default=None,
                                help=f"{f.metadata['help']}. Default: {default}")


def add_model_args(
    parser: argparse.ArgumentParser, allow_auto: bool = False, default_gamma: int | str = AUTO
) -> None:
    """``--model``, ``--draft-model``, the drafter flags, γ, dtypes and the lossy typical acceptance.

    With ``allow_auto``, ``--num-draft-tokens`` also takes ``auto`` (``pacing.make_pacer``).
    """
    parser.add_argument(
        "--model",
        default="default",
        help="target: an mlx-lm folder, a Hugging Face repo id, a .gguf file, or a named model: "
        f"{', '.join(NAMED_MODELS)} ('default' is SmolLM2-135M-Instruct). Default: default",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft model (same kinds of spec as --model); must share the target's tokenizer. Default with "
        "--drafter draft: the one shipped in models/draft/ for the target, if any",
    )
    add_drafter_args(parser)
    # see check_args
    parser.set_defaults(gamma_default=default_gamma if allow_auto else DEFAULT_NUM_DRAFT_TOKENS)
    if allow_auto:
        parser.add_argument(
            "--num-draft-tokens",
            type=num_draft_tokens_arg,
            default=default_gamma,
            help=f"γ, tokens drafted per round, 0 to {MAX_NUM_DRAFT_TOKENS}; 0 = plain decoding; "
            "'auto' lets a tree drafter keep its own depth and picks γ for the others each round from costs "
            "measured on this machine (once, cached) and the running acceptance, falling back to plain "
            "decoding when speculation would lose; 'scheduled' (draft, medusa, eagle, dflash, dspark) drafts "
            "the drafter's full length and verifies the part with the best predicted tokens/s from the "
            "draft's own confidence (docs/acceptance.md 3.1). "
            f"Default: {default_gamma}",
        )
    else:
        parser.add_argument(
            "--num-draft-tokens",
            type=int,
            default=DEFAULT_NUM_DRAFT_TOKENS,
            help=f"γ, tokens drafted per round, 0 to {MAX_NUM_DRAFT_TOKENS}; 0 = plain decoding. Default: "
            f"{DEFAULT_NUM_DRAFT_TOKENS}",
        )
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="load the target in this float dtype (dequantizes a quantized model). Default: "
                             "as stored")
    parser.add_argument("--draft-dtype", choices=DTYPES, default=None,
                        help="the same for the draft model. Default: as stored")
    parser.add_argument(
        "--typical-threshold",
        type=float,
        default=None,
        help="LOSSY: Medusa's typical acceptance threshold ε (e.g. 0.09); needs --typical-alpha",
    )
    parser.add_argument(
        "--typical-alpha",
        type=float,
        default=None,
        help="LOSSY: Medusa's typical acceptance factor δ (e.g. 0.3); needs --typical-threshold",
    )


def drafter_spec_from_args(args: argparse.Namespace, name: str | None = None) -> DrafterSpec:
    """The ``DrafterSpec`` the flags name: ``--drafter`` (default: draft with ``--draft-model``, else
    ngram) with its spec-string options, overridden by its own flags (``--eagle-depth``, ...).

    Raises:
        ValueError: an option value the drafter refuses, naming the flag.
    """
    spec = args.drafter if name is None else DrafterSpec(name)
    if spec is None:
        spec = default_drafter(args.draft_model)
    if name is None:
        check_no_other_drafter_flags(args, spec.name)
    return with_drafter_flags(spec, args)


def check_no_other_drafter_flags(args: argparse.Namespace, drafter: str) -> None:
    """Refuse another drafter's flags (``--eagle-heads`` while the drafter is ngram), which would be ignored.

    Raises:
        ValueError: naming the flag, the drafter in use and the ``--drafter`` that takes it.
    """
    for other in drafter_types():
        given = drafter_flags_given(args, other) if other != drafter else {}
        if given:
            flag = f"--{other}-{next(iter(given)).replace('_', '-')}"
            raise ValueError(f"{flag} is an option of the {other} drafter, but the drafter is {drafter}; add "
                             f"--drafter {other}, or leave {flag} out")


def drafter_flags_given(args: argparse.Namespace, name: str) -> dict:
    """The options of drafter ``name`` set by its own flags (``--eagle-heads X`` → ``{"heads": "X"}``)."""
    fields = dataclasses.fields(drafter_types()[name].options)
    given = {f.name: getattr(args, f"{name}_{f.name}", None) for f in fields}
    return {key: value for key, value in given.items() if value is not None}


def with_drafter_flags(spec: DrafterSpec, args: argparse.Namespace) -> DrafterSpec:
    """``spec`` with the options its drafter's own flags set. A key set both by ``--drafter``'s spec text
    and by its flag must agree (``--drafter eagle:depth=4 --eagle-depth 5`` is refused, not run at 5).

    Raises:
        ValueError: an option value the drafter refuses, naming the flag; or a spec key and its flag that
            disagree, naming both.
    """
    given = drafter_flags_given(args, spec.name)
    spec_keys = getattr(args, "drafter_keys", None) or {}
    if args_spec := getattr(args, "drafter", None):
        for key, value in given.items():
            if key in spec_keys and args_spec.name == spec.name and getattr(args_spec.options, key) != value:
                flag = f"--{spec.name}-{key.replace('_', '-')}"
                raise ValueError(
                    f"--drafter {spec_keys[key]} and {flag} {value} both set the {spec.name} drafter's "
                    f"{key}; keep one"
                )
    return spec.replace(**given)


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                      max_tokens_help: str = "most tokens to generate") -> None:
    """Sampling flags, named as in ``mlx_lm.generate`` (``--max-tokens`` with this default and help)."""
    parser.add_argument("--max-tokens", "-m", type=int, default=max_tokens,
                        help=f"{max_tokens_help}. Default: {max_tokens}")
    parser.add_argument(
        "--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy. Default: 0"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]. Default: 1"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off. Default: 0"
    )
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="min-p filter in [0, 1); 0 = off. Default: 0"
    )
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="mlx-lm's repetition penalty (> 0; 1 = off). Default: off")
    parser.add_argument(
        "--seed", type=seed_arg, default=None, help="random seed in [0, 2**64). Default: none"
    )
    parser.add_argument(
        "--stop",
        action="append",
        type=stop_arg,
        default=None,
        metavar="TEXT",
        help="end the answer at this text, which is not printed; repeat for several. Default: none",
    )


def add_shard_arg(parser: argparse.ArgumentParser, ranks: str) -> None:
    """``--shard {tensor,pipeline}`` (docs/distributed.md); ``ranks`` says what the ranks do, e.g. "only rank
    0 prints"."""
    parser.add_argument(
        "--shard",
        choices=SHARD_KINDS,
        default=None,
        help="split the target over the processes of an mlx.launch job: 'tensor' (every rank holds "
        f"part of every layer) or 'pipeline' (every rank holds some layers); {ranks}. γ 'auto' is then the "
        f"fixed {DEFAULT_NUM_DRAFT_TOKENS} (costs are not measured per "
        "rank). See docs/distributed.md. Default: the whole model in this process",
    )


def add_recalibrate_arg(parser: argparse.ArgumentParser) -> None:
    """``--recalibrate``: measure the costs behind ``auto`` again
    (``pacing.load_or_calibrate(refresh=True)``)."""
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="with --num-draft-tokens auto or scheduled: measure this machine's verify and draft costs again "
        "(after a BLAS, load or hardware change) instead of using the cached ones",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """Validated ``SamplingParams`` from the parsed flags (raises ``ValueError``)."""
    return SamplingParams(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty)


def check_args(args: argparse.Namespace, *, one_drafter: bool = True) -> None:
    """Reject absurd numbers before any model is loaded (every drafter's flags, even unused ones).

    Args:
        args: The parsed flags.
        one_drafter: The command runs the one drafter the flags name (``generate``, ``verify``), so a
            ``--draft-model`` that drafter does not use is refused; ``chat`` passes ``False`` (F2 can switch
            to the draft drafter, which then uses it). Default: ``True``.

    Raises:
        ValueError: naming the flag and the allowed range (or the flag no drafter uses).
    """
    if isinstance(args.num_draft_tokens, int):
        check_num_draft_tokens(args.num_draft_tokens, "--num-draft-tokens")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampling_from_args(args)
    typical_from_args(args)
    check_stops(getattr(args, "stop", None))
    check_drafter_args(args)
    spec = drafter_spec_from_args(args)
    gamma_default = getattr(args, "gamma_default", AUTO)
    if one_drafter and spec.kind.plain and args.num_draft_tokens not in (AUTO, 0, gamma_default):
        raise ValueError(
            f"--num-draft-tokens {args.num_draft_tokens} is for a drafter, but the drafter is none (plain "
            "decoding); pass --drafter ngram (or another), or leave out --num-draft-tokens"
        )
    given = [
        flag
        for flag, value in (("--draft-model", args.draft_model), ("--draft-dtype", args.draft_dtype))
        if value
    ]
    if one_drafter and given and not spec.kind.needs_draft_model:
        takes = " or ".join(k.name for k in drafter_types().values() if k.needs_draft_model)
        raise ValueError(
            f"{given[0]} is used by the {takes} drafter only, but the drafter is {spec.name}; pass --drafter "
            f"{takes}, or leave out {' and '.join(given)}"
        )
    draft_model_spec(spec, model_spec(args, draft=True), model_spec(args), args.draft_dtype)


def check_drafter_args(args: argparse.Namespace) -> None:
    """Validate every drafter's flags, even those of drafters not chosen (raises ``ValueError`` naming the
    flag)."""
    for name in drafter_types():
        drafter_spec_from_args(args, name)


def model_spec(args: argparse.Namespace, draft: bool = False) -> ModelSpec | None:
    """``--model``/``--dtype`` (or ``--draft-model``/``--draft-dtype``) as a ``ModelSpec``; ``None`` for no
    draft model."""
    if draft:
        return ModelSpec(args.draft_model, args.draft_dtype) if args.draft_model else None
    return ModelSpec(args.model, args.dtype, getattr(args, "shard", None))


def typical_from_args(args: argparse.Namespace) -> tuple[float, float] | None:
    """``(threshold, alpha)`` for the lossy typical acceptance, or ``None`` (exact).

    Raises:
        ValueError: when only one of the two flags is given (Medusa's own helpers swap
            their defaults, so both must be named), or a value out of range (``arguments.check_typical``,
            what ``stream_generate`` checks too).
    """
    given = (args.typical_threshold, args.typical_alpha)
    if given == (None, None):
        return None
    if None in given:
        raise ValueError("typical acceptance needs both --typical-threshold and --typical-alpha "
                         "(Medusa's defaults are 0.09 and 0.3)")
    return check_typical(given)


@dataclass
class LoadedModels:
    """The target, the draft model (if any) and the drafter the flags name."""

    target: LoadedModel
    draft: LoadedModel | None
    drafter: Drafter

    @property
    def model(self):
        return self.target.model

    @property
    def tokenizer(self):
        return self.target.tokenizer


def load_models(args: argparse.Namespace, on_measure=None) -> LoadedModels:
    """Load the target (and draft model) named by the flags and build the drafter.

    Raises:
        ValueError, FileNotFoundError: for bad specs or mismatched tokenizers.
    """
    target = load_model(model_spec(args))
    split = sharding(target.model)
    if split is None:
        drafter, draft = build_drafter(args, target, on_measure)
        return LoadedModels(target, draft, drafter)

    def checked() -> tuple[Drafter, LoadedModel | None]:  # every rank builds the same drafter: refused once
        drafter, draft = build_drafter(args, target, on_measure)
        check_drafter(target.model, drafter)
        return drafter, draft

    drafter, draft = together(split.group, checked)
    return LoadedModels(target, draft, drafter)


def build_drafter(
    args: argparse.Namespace, target: LoadedModel, on_measure=None
) -> tuple[Drafter, LoadedModel | None]:
    """The drafter the flags name for a loaded target, and the draft model it loaded (if any).

    Raises:
        ValueError, FileNotFoundError: for bad specs or mismatched tokenizers.
    """
    spec = drafter_spec_from_args(args)
    draft_spec = draft_model_spec(spec, model_spec(args, draft=True), target.spec, args.draft_dtype)
    draft = (
        load_model(draft_spec, role="draft model")
        if draft_spec is not None and spec.kind.needs_draft_model
        else None
    )
    return session_build_drafter(spec, target, draft, on_measure), draft


def measuring_note(why: str):
    """An ``on_measure`` callback that says on stderr what is being measured, and ``why``."""

    def note(what: str) -> None:
        print(
            f"mlxspec: measuring {what} on this machine for {why} (once; cached)", file=sys.stderr, flush=True
        )

    return note


def fail(message: str) -> int:
    """Print a one-line error and return the exit status for user errors."""
    print(f"mlxspec: error: {message}", file=sys.stderr)
    return 2


def add_blas_arg(parser: argparse.ArgumentParser) -> None:
    """``--blas {auto,keep}``: on Linux, re-run with OpenBLAS preloaded when MLX uses the reference BLAS."""
    parser.add_argument(
        "--blas",
        choices=("auto", "keep"),
        default="auto",
        help="Linux: 'auto' re-runs the command with OpenBLAS preloaded when MLX's matmuls use the slow "
        "reference BLAS and OpenBLAS is installed (speculation needs it to pay off); 'keep' runs as is. "
        "Default: auto",
    )


def use_fast_blas(command: str, argv: list[str], mode: str, *, quiet: bool = False) -> None:
    """On Linux with the reference BLAS loaded and OpenBLAS installed, re-run ``mlxspec COMMAND ARGV`` with it
    preloaded.

    ``LD_PRELOAD`` only works from the start of a process, hence ``os.execve``; the command is
    printed unless ``quiet``. Without OpenBLAS, one line says how to install it. Of the ranks of an
    ``mlx.launch`` job only rank 0 says either (the others do the same, quietly).
    """
    if mode != "auto" or not sys.platform.startswith("linux") or os.environ.get(REEXEC_ENV):
        return
    other_rank = os.environ.get("MLX_RANK", "0") != "0"
    if blas_in_use()["name"] != "reference BLAS":
        return
    fast = find_fast_blas()
    if fast is None:
        if other_rank:
            return
        print(
            f"mlxspec {command}: MLX uses the reference BLAS, where verifying k tokens costs about k steps; "
            "install OpenBLAS (apt-get install libopenblas0-pthread) for speculation to pay off",
            file=sys.stderr,
        )
        return
    preload = ":".join(filter(None, [fast, os.environ.get("LD_PRELOAD")]))
    command_line = [sys.executable, "-m", "mlxspec", command, *argv]
    # the command last, as a shell would take it: the line can be copied and pasted
    if not (quiet or other_rank):
        print(f"mlxspec {command}: re-running with a fast BLAS (--blas keep to skip): "
              f"LD_PRELOAD={shlex.quote(preload)} {shlex.join(command_line)}", file=sys.stderr, flush=True)
    os.execve(sys.executable, command_line, {**os.environ, "LD_PRELOAD": preload, REEXEC_ENV: "1"})


def run_main(
    command: str,
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None,
    *,
    entry: bool = False,
    fast_blas: bool = False,
    quiet_blas: bool = True,
) -> int:
    """What every subcommand's ``main`` does: parse, run, and turn user errors into one line.

    Args:
        command: The subcommand's name, e.g. ``"generate"``.
        parser: Its parser (``setup_arg_parser()``).
        run: ``run(args) -> int``, the exit status.
        argv: The arguments after the subcommand; ``None`` reads ``sys.argv[1:]``.
        entry: Whether this is the process's entry point (``mlxspec ...``, not a call from Python):
            only then may it re-run itself with OpenBLAS (``use_fast_blas``). Default: ``False``.
        fast_blas: Whether the command takes ``--blas`` and wants OpenBLAS. Default: ``False``.
        quiet_blas: Re-run without printing the command line. Default: ``True``.

    Returns:
        int: ``run``'s status; 2 on a user error (``mlxspec: error: ...``: a ``USER_ERRORS``, any other
        ``OSError`` such as a full disk, or an MLX I/O ``RuntimeError``), 130 on Ctrl-C, 0 when the reader of
        stdout went away (``| head``).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if entry and fast_blas:
        use_fast_blas(command, argv, args.blas, quiet=quiet_blas)
    try:
        return run(args)
    except USER_ERRORS as e:
        return fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a full disk, a read-only folder: the system's reason, in one line
        return fail(os_error_line(e))
    except RuntimeError as e:  # MLX's own I/O errors are the user's disk, not a bug: one line too
        if not is_mlx_error(e):
            raise
        return fail(f"MLX: {e}")


def os_error_line(e: OSError) -> str:
    """An ``OSError`` as one line: ``No space left on device: out/model.safetensors``."""
    if e.strerror and e.filename:
        return f"{e.strerror}: {e.filename}"
    return e.strerror or str(e)


def is_mlx_error(e: BaseException) -> bool:
    """Whether a ``RuntimeError`` is one of MLX's I/O errors (``[write] Unable to write ...``,
    ``[save_safetensors] Failed to open file ...``): its message starts with the failing routine in
    brackets."""
    return isinstance(e, RuntimeError) and re.match(r"\[[\w:]+\] ", str(e)) is not None
