"""Flags and set-up shared by ``mlxspec generate`` and ``mlxspec chat``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from ..assets import require_shipped, shipped
from ..drafters import DRAFTERS, Drafter, make_drafter
from ..drafters.ngram import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM
from ..generate import AUTO, DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS
from ..sampling import SamplingParams
from ..tree import DEFAULT_TREE, TREE_PRESETS, read_tree

DTYPES = ("float32", "float16", "bfloat16")
#: Errors a user can cause (bad files, bad flags); printed as one line, never a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


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


def num_draft_tokens_arg(value: str) -> int | str:
    """``--num-draft-tokens``, ``--eagle-total-tokens``: an integer or ``auto``."""
    if value == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def add_model_args(parser: argparse.ArgumentParser, allow_auto: bool = False) -> None:
    """``--model``, ``--draft-model``, ``--drafter``, γ, n-gram sizes and dtypes.

    With ``allow_auto``, ``--num-draft-tokens`` also takes ``auto``, its default.
    """
    parser.add_argument("--model", default="default",
                        help="target: an mlx-lm folder, a Hugging Face repo id, a .gguf file, or "
                             "'default' (SmolLM2-135M-Instruct). Default: default")
    parser.add_argument("--draft-model", default=None,
                        help="draft model (same kinds of spec as --model); must share the target's tokenizer. "
                             "Default with --drafter draft: the one shipped in models/draft/ for the target, if any")
    parser.add_argument("--drafter", choices=DRAFTERS, default=None,
                        help="how tokens are proposed. Default: draft with --draft-model, else ngram")
    if allow_auto:
        parser.add_argument("--num-draft-tokens", type=num_draft_tokens_arg, default=AUTO,
                            help="γ, tokens drafted per round; 0 = plain decoding; 'auto' picks γ each round "
                                 "from costs measured on this machine (once, cached) and the running "
                                 "acceptance, falling back to plain decoding when speculation would lose. "
                                 "Default: auto")
    else:
        parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                            help=f"γ, tokens drafted per round; 0 = plain decoding. Default: {DEFAULT_NUM_DRAFT_TOKENS}")
    parser.add_argument("--ngram-min", type=int, default=DEFAULT_MIN_NGRAM,
                        help=f"shortest suffix the n-gram drafter matches. Default: {DEFAULT_MIN_NGRAM}")
    parser.add_argument("--ngram-max", type=int, default=DEFAULT_MAX_NGRAM,
                        help=f"longest suffix the n-gram drafter matches. Default: {DEFAULT_MAX_NGRAM}")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="load the target in this float dtype (dequantizes a quantized model). "
                             "Default: as stored")
    parser.add_argument("--draft-dtype", choices=DTYPES, default=None,
                        help="the same for the draft model. Default: as stored")
    parser.add_argument("--medusa-heads", default=None,
                        help="Medusa heads: a folder, a medusa_lm_head.safetensors/.pt file, or a Hugging Face "
                             "repo id. Default: the heads shipped in models/medusa/ for the target, if any")
    parser.add_argument("--medusa-tree", default=DEFAULT_TREE,
                        help=f"Medusa tree: a preset ({', '.join(TREE_PRESETS)}) or a JSON file of rank paths. "
                             f"Default: {DEFAULT_TREE}")
    parser.add_argument("--eagle-heads", default=None,
                        help="EAGLE-1/2/3 head: a folder (config.json + model.safetensors or pytorch_model.bin), "
                             "a weights file, or a Hugging Face repo id. Default: the head shipped in "
                             "models/eagle/ for the target, if any")
    parser.add_argument("--eagle-depth", type=int, default=None,
                        help="deepest EAGLE draft node (the tree's γ; --num-draft-tokens caps it). "
                             "Default: the shipped head's setting, else 6 (EAGLE-2)")
    parser.add_argument("--eagle-top-k", type=int, default=None,
                        help="EAGLE children per expanded node and frontier width; 1 drafts a chain. "
                             "Default: the shipped head's setting, else 10 (EAGLE-2)")
    parser.add_argument("--eagle-total-tokens", type=num_draft_tokens_arg, default=None,
                        help="EAGLE tree nodes per verify forward, root included, or 'auto': each round keeps "
                             "the nodes with the best predicted tokens/s from this machine's measured verify cost "
                             "(at most 64). Default: the shipped head's setting, else 60 (EAGLE-2)")
    parser.add_argument("--eagle-ngram", type=int, default=None,
                        help="also merge the n-gram prompt lookup's continuation (up to N tokens, capped by the "
                             "depth) into each EAGLE tree as one more branch; 0 = EAGLE alone. "
                             "Default: the shipped head's setting, else 0")
    parser.add_argument("--eagle-tree", default=None,
                        help="EAGLE tree: 'dynamic' (EAGLE-2), 'eagle1_25' (EAGLE-1's static tree) or a JSON file "
                             "of rank paths (a rank indexes the draft's top-k at the parent). "
                             "Default: the shipped head's setting, else dynamic")
    parser.add_argument("--typical-threshold", type=float, default=None,
                        help="LOSSY: Medusa's typical acceptance threshold ε (e.g. 0.09); needs --typical-alpha")
    parser.add_argument("--typical-alpha", type=float, default=None,
                        help="LOSSY: Medusa's typical acceptance factor δ (e.g. 0.3); needs --typical-threshold")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags, named as in ``mlx_lm.generate``."""
    parser.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"most tokens to generate. Default: {DEFAULT_MAX_TOKENS}")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy. Default: 0")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]. Default: 1")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off. Default: 0")
    parser.add_argument("--min-p", type=float, default=0.0, help="min-p filter in [0, 1); 0 = off. Default: 0")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="mlx-lm's repetition penalty (> 0; 1 = off). Default: off")
    parser.add_argument("--seed", type=seed_arg, default=None, help="random seed in [0, 2**64). Default: none")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """Validated ``SamplingParams`` from the parsed flags (raises ``ValueError``)."""
    return SamplingParams(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty)


def check_args(args: argparse.Namespace) -> None:
    """Reject absurd numbers before any model is loaded.

    Raises:
        ValueError: naming the flag and the allowed range.
    """
    if args.num_draft_tokens != AUTO and args.num_draft_tokens < 0:
        raise ValueError(f"--num-draft-tokens must be >= 0, got {args.num_draft_tokens}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampling_from_args(args)
    make_drafter("ngram", min_ngram=args.ngram_min, max_ngram=args.ngram_max)
    if args.drafter == "draft" and args.draft_model is None:
        raise ValueError("--drafter draft needs a draft model: pass --draft-model PATH_OR_REPO")
    typical_from_args(args)
    read_tree(args.medusa_tree)
    for flag, least in (("eagle_depth", 1), ("eagle_top_k", 1), ("eagle_total_tokens", 2), ("eagle_ngram", 0)):
        value = getattr(args, flag, None)
        if value is not None and value != "auto" and value < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {value}")
    from ..tree import read_eagle_tree

    read_eagle_tree(getattr(args, "eagle_tree", None))


def typical_from_args(args: argparse.Namespace) -> tuple[float, float] | None:
    """``(threshold, alpha)`` for the lossy typical acceptance, or ``None`` (exact).

    Raises:
        ValueError: when only one of the two flags is given (Medusa's own helpers swap
            their defaults, so both must be named).
    """
    given = (args.typical_threshold, args.typical_alpha)
    if given == (None, None):
        return None
    if None in given:
        raise ValueError("typical acceptance needs both --typical-threshold and --typical-alpha "
                         "(Medusa's defaults are 0.09 and 0.3)")
    return given


@dataclass
class LoadedModels:
    """The target, its tokenizer, the drafter, and display names."""

    model: object
    tokenizer: object
    drafter: Drafter
    model_name: str
    draft_name: str | None


def load_models(args: argparse.Namespace) -> LoadedModels:
    """Load the target (and draft model) named by the flags and build the drafter.

    Raises:
        ValueError, FileNotFoundError: for bad specs or mismatched tokenizers.
    """
    from ..loading import describe, load

    model, tokenizer = load(args.model, dtype=args.dtype)
    drafter, draft_name = build_drafter(args, model, tokenizer, describe(args.model, model))
    return LoadedModels(model, tokenizer, drafter, describe(args.model, model), draft_name)


def build_drafter(args: argparse.Namespace, model, tokenizer, model_name: str) -> tuple[Drafter, str | None]:
    """The drafter the flags name, for an already loaded target; and the draft model's name, if any.

    Raises:
        ValueError, FileNotFoundError: for bad specs or mismatched tokenizers.
    """
    from ..loading import describe, load

    kind = args.drafter or ("draft" if args.draft_model else "ngram")
    draft_model = draft_tokenizer = draft_name = None
    if kind == "draft":
        spec = args.draft_model or shipped_draft(model_name.split(" (")[0])
        try:
            draft_model, draft_tokenizer = load(spec, dtype=args.draft_dtype)
        except USER_ERRORS as e:
            raise type(e)(f"draft model: {e}") from e
        draft_name = describe(spec, draft_model)
    heads = load_heads(args.medusa_heads, model, model_name) if kind == "medusa" else None
    eagle = load_eagle_head(getattr(args, "eagle_heads", None), model, model_name) if kind == "eagle" else None
    drafter = make_drafter(kind, target=model, tokenizer=tokenizer,
                           draft_model=draft_model, draft_tokenizer=draft_tokenizer,
                           min_ngram=args.ngram_min, max_ngram=args.ngram_max,
                           medusa_heads=heads, medusa_tree=args.medusa_tree, eagle_head=eagle,
                           eagle_depth=getattr(args, "eagle_depth", None), eagle_top_k=getattr(args, "eagle_top_k", None),
                           eagle_total_tokens=getattr(args, "eagle_total_tokens", None),
                           eagle_tree=getattr(args, "eagle_tree", None), eagle_ngram=getattr(args, "eagle_ngram", None),
                           eagle_costs=lambda: _verify_costs(model))
    return drafter, draft_name


def _verify_costs(model):
    """The target's measured verify costs (an 'auto' EAGLE tree size), saying when they are measured."""
    from ..costmodel import load_or_calibrate

    def note(what: str) -> None:
        print(f"mlxspec: measuring {what} on this machine for the automatic EAGLE tree size (once; cached)",
              file=sys.stderr, flush=True)

    return load_or_calibrate(model, on_measure=note)


def shipped_draft(name: str) -> str:
    """The draft model shipped in ``models/draft/<name>/`` for the target called ``name``.

    Raises:
        ValueError: none ships for it.
    """
    path = shipped("draft", name)
    if path is None:
        raise ValueError(f"--drafter draft needs a draft model: pass --draft-model PATH_OR_REPO (none ships for "
                         f"{name}; distil one with 'mlxspec train draft')")
    return str(path)


def use_shipped_draft(args: argparse.Namespace) -> None:
    """``--drafter draft`` without ``--draft-model``: name the draft shipped for the target, if any
    (before ``check_args``, which refuses a draft drafter without a draft model)."""
    from ..loading import model_name

    if args.drafter == "draft" and args.draft_model is None:
        path = shipped("draft", model_name(args.model))
        args.draft_model = str(path) if path is not None else None


def load_heads(spec: str | None, model, model_name: str):
    """Medusa heads named by ``--medusa-heads``, or the ones shipped for this target.

    Raises:
        ValueError, FileNotFoundError: no heads for this target, or heads that do not fit it.
    """
    from ..heads.medusa import load_medusa, medusa_folder
    from ..taps import logits_width

    base_name = model_name.split(" (")[0]
    path = medusa_folder(spec) if spec else require_shipped("medusa", base_name)
    return load_medusa(path, hidden_size=model.args.hidden_size, vocab_size=logits_width(model))


def load_eagle_head(spec: str | None, model, model_name: str):
    """The EAGLE head named by ``--eagle-heads``, or the one shipped for this target.

    Raises:
        ValueError, FileNotFoundError: no head for this target, or a head that does not fit it.
    """
    from ..heads.eagle import load_eagle

    base_name = model_name.split(" (")[0]
    path = spec if spec else require_shipped("eagle", base_name)
    return load_eagle(path, model)


def fail(message: str) -> int:
    """Print a one-line error and return the exit status for user errors."""
    print(f"mlxspec: error: {message}", file=sys.stderr)
    return 2
