"""``mlxspec convert SRC OUT``: any model spec to an mlx-lm folder that ``mlx_lm.load`` opens unchanged.

SRC is anything ``mlxspec.load`` takes (a GGUF file, a named model such as ``qwen2.5-coder-1.5b``,
an mlx-lm folder, a Hugging Face repo id). OUT gets ``config.json`` (with a per-layer
``quantization`` section when layers stay quantized, and the end-of-turn ids as
``eos_token_id``), ``model*.safetensors`` and the tokenizer files with the chat template. Without
``--dtype`` quantized layers stay quantized exactly as loaded (a GGUF's Q4_K stays 4-bit with the
same values); with it everything is dequantized and cast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import mlx.nn as nn

from ..loading.weights import DTYPES, QUANTIZED_TYPES
from .common import ArgumentParser, is_mlx_error, run_main


def setup_arg_parser() -> argparse.ArgumentParser:
    """The ``mlxspec convert`` flags."""
    parser = ArgumentParser(
        prog="mlxspec convert",
        description="Write any model spec as an mlx-lm folder that mlx_lm.load opens unchanged. Without "
        "--dtype, quantized layers stay quantized exactly as loaded; with it, everything is dequantized and "
        "cast.",
    )
    parser.add_argument("src", metavar="SRC",
                        help="model: a .gguf file, a named model (e.g. qwen2.5-coder-1.5b), an mlx-lm folder "
                             "or a Hugging Face repo id")
    parser.add_argument("out", metavar="OUT", help="the mlx-lm folder to write (must not exist, or be empty)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dequantize everything and cast to this dtype. Default: keep quantized layers "
                             "quantized and the other weights as stored")
    parser.add_argument("--requantize", action="store_true",
                        help="GGUF Q2_K/Q3_K/Q6_K tensors: re-quantize to 8-bit groups of 32 (lossy) instead "
                             "of dequantizing them to float32")
    return parser


def quantization_config(model: nn.Module) -> dict | None:
    """The ``quantization`` section of ``config.json`` for ``model``'s quantized layers.

    Args:
        model (nn.Module): A loaded mlx-lm model.

    Returns:
        dict | None: The most common group size and bits at the top, and one entry per quantized
        layer path (``{"group_size", "bits", "mode"}``) so mixed-bit models load exactly; ``None``
        when no layer is quantized.
    """
    layers = {
        path: {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
        for path, m in model.named_modules()
        if isinstance(m, QUANTIZED_TYPES)
    }
    if not layers:
        return None
    common = Counter((q["group_size"], q["bits"]) for q in layers.values()).most_common(1)[0][0]
    return {"group_size": common[0], "bits": common[1], "mode": "affine", **dict(sorted(layers.items()))}


def convert(src: str, out: str | Path, *, dtype: str | None = None, requantize: bool = False) -> Path:
    """Load ``src`` with ``mlxspec.load`` and write it as an mlx-lm folder.

    Everything is written into ``OUT.partial`` first and renamed to ``OUT`` only when every file is complete
    (each safetensors file's size checked against its header), so a full disk or a kill never leaves a
    truncated model under ``OUT``. A failed write removes ``OUT.partial`` (freeing the space); one left by a
    killed run, or an unfinished ``OUT`` an older version left (conversion files only, a model but no
    ``config.json`` or a truncated safetensors file), is replaced with a note on stderr.

    Args:
        src (str): Any model spec ``mlxspec.load`` accepts.
        out (str | Path): The folder to write; created, and must be empty if it exists.
        dtype (str | None): As in ``mlxspec.load``: ``None`` keeps quantized layers. Default: ``None``.
        requantize (bool): As in ``mlxspec.load``. Default: ``False``.

    Returns:
        Path: ``out``.

    Raises:
        ValueError: ``out`` is a non-empty folder or a file; ``src`` cannot be loaded (see
            ``mlxspec.load``).
        FileNotFoundError: ``src`` does not exist.
        OSError: ``out`` could not be written (a read-only folder, a full disk), naming it; nothing is left.
    """
    from mlx_lm.utils import save_config, save_model

    from ..loading.models import load

    out = Path(out).expanduser()
    staging = out.with_name(out.name + ".partial")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not (out.is_dir() and unfinished(out)):
            raise ValueError(f"{out} already exists and is not an empty folder; pass a new folder for OUT.")
        print(f"mlxspec convert: {out} holds an unfinished conversion ({unfinished(out)}); replacing it",
              file=sys.stderr)
    if staging.exists():
        print(
            f"mlxspec convert: replacing {staging}, the unfinished output of an earlier run", file=sys.stderr
        )
        shutil.rmtree(staging)
    model, tokenizer = load(src, dtype=dtype, requantize=requantize)
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    if quantization := quantization_config(model):
        config["quantization"] = quantization
    eos = sorted(tokenizer.eos_token_ids)
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    try:
        save_model(staging, model)
        save_config(config, staging / "config.json")
        tokenizer.save_pretrained(str(staging))
        if problem := unfinished(staging):
            raise OSError(f"the written files are incomplete ({problem})")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, RuntimeError) and not is_mlx_error(e):
            raise
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise OSError(f"could not write {out} ({reason}); nothing was left behind: free space or choose a "
                      "writable folder and run again") from e
    return out


def unfinished(folder: Path) -> str | None:
    """Why ``folder`` is an unfinished conversion (a truncated safetensors file, or a model without
    ``config.json``), or ``None`` if it is not one: complete, or holding files a conversion does not write."""
    files = [p for p in folder.iterdir()]
    ours = lambda p: p.name.startswith(("model", "config", "tokenizer", "special_tokens", "vocab", "merges",  # noqa: E731
                                        "added_tokens", "chat_template", "generation_config"))
    if not files or not all(p.is_file() and ours(p) for p in files):
        return None
    for path in sorted(folder.glob("*.safetensors")):
        size, expected = path.stat().st_size, safetensors_size(path)
        if expected is None or size != expected:
            return f"{path.name} has {size} bytes" + (
                f" of {expected}" if expected else ", no complete header"
            )
    if not (folder / "config.json").exists():
        return "no config.json"
    return None


def safetensors_size(path: Path) -> int | None:
    """The size a complete safetensors file has, from its header (8-byte length, JSON with each tensor's
    ``data_offsets``), or ``None`` when the header itself is cut off."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            return None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)


def run(args: argparse.Namespace) -> int:
    """Convert ``args.src`` into ``args.out``; returns 0."""
    out = convert(args.src, args.out, dtype=args.dtype, requantize=args.requantize)
    print(f"mlxspec: wrote {out} (load it with mlx_lm.load({str(out)!r}) or --model {out})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None, *, entry: bool = False) -> int:
    """Run ``mlxspec convert``; returns the exit status (2 on a user error)."""
    return run_main("convert", setup_arg_parser(), run, argv, entry=entry)
