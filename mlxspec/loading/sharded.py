"""Splitting a loaded model over the ranks of a job with mlx-lm's own methods (docs/distributed.md).

``shard`` splits a model whose weights are not yet evaluated (``models.load(lazy=True)``) and then
evaluates only this rank's share: ``model.shard(group)`` (tensor-parallel: each rank holds 1/N of
every attention and MLP projection; the ``sharded-to-all`` layers sum the partial outputs with one
all-reduce) or ``model.model.pipeline(group)`` (pipeline-parallel: each rank holds a run of layers).
mlx-lm's ``sharded_load`` does the same for a Hugging Face folder; this does it for every spec
``models.load`` takes. ``check_shardable`` answers from a model's config alone, before any weight is
read, whether a split can work and what to pass instead.

What a sharded job decides beyond the model (γ, seeds, the drafter, printing once) is ``mlxspec.sharding``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from ..runtime.distributed import Sharding, mark_sharded
from . import assets, gguf
from .models import NAMED_MODELS, hub_folder, looks_like_repo_id

#: How ``--shard`` splits a target.
SHARD_KINDS = ("tensor", "pipeline")


def shard(model: nn.Module, kind: str, group) -> Sharding:
    """Split ``model`` over ``group`` with mlx-lm's own sharding, in place, and evaluate its weights.

    Given unevaluated weights (``models.load(lazy=True)``), a rank reads and decodes only what its share
    needs, one parameter at a time: its peak memory is its share plus one whole tensor for a moment.

    Args:
        model: A whole mlx-lm model, its weights evaluated or not (every rank loaded the same weights).
        kind: ``"tensor"`` (``model.shard``) or ``"pipeline"`` (``model.model.pipeline``).
        group: An ``mx.distributed.Group`` of at least two ranks.

    Returns:
        Sharding: also recorded on the model (``distributed.sharding(model)`` reads it).

    Raises:
        ValueError: a split ``check_split`` refuses; weights that cannot be read (a lazily loaded file).
    """
    check_split(model, kind, group.size())
    if kind == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    try:
        for _, weight in tree_flatten(model.parameters()):  # one at a time: one whole tensor decoded at once
            mx.eval(weight)
    except RuntimeError as e:  # a lazily loaded file is read here
        raise ValueError(
            f"reading this rank's share of the weights failed ({str(e).strip()}); check that the model's "
            "files are complete on every machine"
        ) from e
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank is ready
    return mark_sharded(model, Sharding(kind, group))


def check_split(model: nn.Module, kind: str, ranks: int) -> None:
    """Refuse a split of ``model`` (weights evaluated or not) over ``ranks`` that mlx-lm cannot make.

    Raises:
        ValueError: an unknown kind; a model mlx-lm cannot split that way; head counts or widths that do not
            divide by ``ranks``; more ranks than layers. The message names a fix that works for this model:
            the other kind only where it can split this model over ``ranks``.
    """
    if kind not in SHARD_KINDS:
        raise ValueError(f"unknown --shard {kind!r}; choose one of {', '.join(SHARD_KINDS)}")
    problem = split_problem(model, kind, ranks)
    if problem is None:
        return
    other = "pipeline" if kind == "tensor" else "tensor"
    if split_problem(model, other, ranks) is None:
        fix = f"use --shard {other}"
    else:
        fix = "run it in one process (leave out --shard and mlx.launch)"
        counts = [n for n in range(2, ranks) if any(p is None for p in _problems(model, n).values())]
        if counts:
            fix = f"use {counts[-1]} ranks, or " + fix
    raise ValueError(f"{problem}; {fix}")


def split_problem(model: nn.Module, kind: str, ranks: int) -> str | None:
    """Why mlx-lm cannot split ``model`` over ``ranks`` the ``kind`` way, or ``None`` when it can."""
    return _problems(model, ranks)[kind]


def _problems(model: nn.Module, ranks: int) -> dict[str, str | None]:
    """Why each kind of split cannot spread ``model`` over ``ranks`` (``None``: it can)."""
    name = getattr(model, "model_type", None) or type(model).__module__.rpartition(".")[2]
    body = getattr(model, "model", None)
    layers = list(getattr(body, "layers", []))
    tensor = pipeline = None
    if not hasattr(model, "shard"):
        tensor = f"mlx-lm cannot split a {name} model tensor-parallel"
    else:
        tensor = _indivisible(layers[:1], ranks, name)
    if not hasattr(body, "pipeline"):
        pipeline = f"mlx-lm cannot split a {name} model into pipeline stages"
    elif len(layers) < ranks:
        pipeline = f"a {len(layers)}-layer model cannot be split into {ranks} pipeline stages"
    return {"tensor": tensor, "pipeline": pipeline}


def _indivisible(layers: list, ranks: int, name: str) -> str | None:
    """Tensor parallelism splits heads and widths evenly: what of the first layer does not divide by
    ``ranks``."""
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        sizes = {
            "attention heads": getattr(attn, "n_heads", 0),
            "key/value heads": getattr(attn, "n_kv_heads", 0),
        }
        if mlp is not None and hasattr(mlp, "up_proj"):
            sizes["MLP width"] = mlp.up_proj.weight.shape[0]
        bad = {k: v for k, v in sizes.items() if v % ranks}
        if bad:
            what = ", ".join(f"{v} {k}" for k, v in bad.items())
            return f"this {name} model has {what}, which {ranks} ranks cannot split evenly"
    return None


def check_shardable(spec: str, kind: str, ranks: int) -> None:
    """``check_split`` from a model spec's config alone, before any weight is read (every rank may call it).

    The model is built from its config (``config.json``, or a GGUF's metadata) with unevaluated weights, which
    costs no memory, and asked what ``check_split`` asks. A spec whose config cannot be read is let through:
    loading it says what is wrong.

    Args:
        spec: What ``models.load`` takes (a folder, a ``.gguf`` file, a repo id or a named model).
        kind: ``"tensor"`` or ``"pipeline"``.
        ranks: The job's number of ranks.

    Raises:
        ValueError: as ``check_split``.
    """
    if kind not in SHARD_KINDS:
        raise ValueError(f"unknown --shard {kind!r}; choose one of {', '.join(SHARD_KINDS)}")
    config = model_config(spec)
    if config is None:
        return
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))  # unevaluated weights: shapes only
    except (ValueError, KeyError, TypeError, AttributeError):
        return  # not a model mlx-lm builds: loading it says so
    check_split(model, kind, ranks)


def model_config(spec: str) -> dict | None:
    """The mlx-lm config of a model spec without reading its weights, or ``None`` when it cannot be read."""
    try:
        if spec in NAMED_MODELS:
            path = assets.named_model_path(spec)
        else:
            path = Path(spec).expanduser()
            if not path.exists() and looks_like_repo_id(spec):
                path = hub_folder(spec, allow_patterns=["config.json"])
        if path.is_dir():
            return json.loads((path / "config.json").read_text())
        if path.suffix.lower() == ".gguf":
            return gguf.model_config(gguf.read_header(path), path)
    except (OSError, ValueError, KeyError):
        return None
    return None
