"""What every head checkpoint shares: finding it, checking its tensors, its dtype, writing it.

The layouts differ (Medusa, EAGLE, DFlash, DSpark; docs/heads.md); these are the steps that do not:
a local path or a Hugging Face repo fetched without code (``local_or_hub``), reading safetensors and
``config.json`` with one-line errors (``load_safetensors``, ``read_config``), tensor names and shapes
against the module's own (``check_tensors``), the dtype a head takes from its target
(``embedding_dtype``), and ``config.json`` beside one safetensors file (``write_checkpoint``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..loading.models import hub_folder, looks_like_repo_id
from ..core.taps import model_body


def local_or_hub(spec: str, allow_patterns: list[str], missing: str) -> Path:
    """A local folder or file, or a Hugging Face repo id fetched with ``huggingface_hub`` (``allow_patterns``
    only).

    Args:
        spec: A path or a repo id.
        allow_patterns: The files fetched from a repo (never code).
        missing: The error's opening for a path that does not exist, e.g. ``"no such DFlash drafter folder"``.

    Raises:
        FileNotFoundError: a path that does not exist and does not look like a repo id.
        ValueError: a repo that cannot be fetched.
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if looks_like_repo_id(spec):
        return hub_folder(spec, allow_patterns=allow_patterns)
    raise FileNotFoundError(f"{missing}: {spec}; pass a path or a Hugging Face repo id")


def load_safetensors(path: Path) -> dict:
    """``mx.load`` of one safetensors file.

    Raises:
        ValueError: a file MLX cannot read (cut off, or another kind of file), naming it.
    """
    try:
        return mx.load(str(path))
    except (RuntimeError, OSError):  # MLX's own message names its reader, not the problem
        raise ValueError(
            f"{path} is not a readable safetensors file: it is cut off or another kind of file"
        ) from None


def read_config(path: Path) -> dict:
    """A checkpoint's ``config.json`` (or another JSON object, such as a safetensors index) as a dict.

    Raises:
        ValueError: a file that is not JSON (cut off, or another kind of file) or not a JSON object,
            naming it.
    """
    try:
        config = json.loads(path.read_text())
    except ValueError:  # JSONDecodeError, UnicodeDecodeError: their messages name a position, not the file
        raise ValueError(f"{path} is not valid JSON: it is cut off or another kind of file") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not a JSON object of settings")
    return config


def _names(keys: list[str], most: int) -> str:
    return ", ".join(keys[:most]) + (" ..." if len(keys) > most else "")


def check_tensors(
    module: nn.Module, weights: dict, source: str, *, lacks: str, extra: str, most: int = 3
) -> None:
    """Refuse weights whose names or shapes differ from ``module``'s parameters (one line each).

    Args:
        module: The freshly built head; its parameters are the layout.
        weights: Name -> array, as read from the checkpoint.
        source: The checkpoint, as the error names it (``"DFlash drafter PATH"``).
        lacks: Completes ``"{source} lacks {names} …"`` (e.g. ``"of the EAGLE-3 layout; is it an EAGLE
            head?"``).
        extra: Completes ``"{source} has unexpected {names} …"``.
        most: Names listed before `` ...``. Default: ``3``.

    Raises:
        ValueError: missing or unexpected tensors, or a tensor whose shape disagrees with the config.
    """
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"{source} lacks {_names(missing, most)} {lacks}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ValueError(f"{source} has unexpected {_names(unexpected, most)} {extra}")
    for key, value in weights.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"{source}: tensor {key} has shape {tuple(value.shape)} but its config.json implies "
                f"{tuple(expected[key].shape)}; the config and weights disagree"
            )


def embedding_dtype(target: nn.Module | None) -> mx.Dtype:
    """The float dtype a head takes by default: the target's embedding (its scales when quantized), else
    float32."""
    if target is None:
        return mx.float32
    emb = model_body(target).embed_tokens
    dtype = emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype
    return dtype if mx.issubdtype(dtype, mx.floating) else mx.float32


def write_checkpoint(folder: str | Path, weights: dict[str, mx.array], config: dict,
                     name: str = "model.safetensors") -> None:
    """Write ``weights`` as ``folder/name`` and ``config`` as ``folder/config.json`` (``folder`` created).

    Args:
        folder: The checkpoint folder.
        weights: Name -> array in the published layout.
        config: The ``config.json`` content.
        name: The safetensors file's name. Default: ``model.safetensors``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / name), weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
