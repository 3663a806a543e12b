"""A target sharded over several processes with MLX's own distributed backend (docs/distributed.md).

Started under ``mlx.launch`` (ring over TCP, JACCL over RDMA, MPI), every process builds the target
with unevaluated weights, and ``shard`` splits it with mlx-lm's own methods: ``model.shard(group)`` (tensor-parallel: each
rank holds 1/N of every attention and MLP projection, and the ``sharded-to-all`` layers sum the
partial outputs with one all-reduce) or ``model.model.pipeline(group)`` (pipeline-parallel: each
rank holds a run of layers; the hidden state is passed on with send/recv and the last stage's
output is all-gathered), and only then evaluates the weights, so each rank materializes its share:
mlx-lm's ``sharded_load`` does the same for a Hugging Face folder with a safetensors index; mlxspec
does it for its usual specs (folders, GGUF, named models; ``loading.models.load(lazy=True)``).

Exactness. Every rank runs the whole speculative loop on the same tokens: the drafter on each rank
(it is small and unsharded, so each rank computes the same draft), the sharded verify forward (every
rank gets the same logits: an all-reduce or all-gather hands each rank the same bits), and the
acceptance draws from ``mx.random`` seeded alike on every rank. So every rank commits the same
tokens with no per-round collective of mlxspec's own. What could make ranks differ is refused when
the job is set up (``check_drafter``, ``check_policy``): a per-machine cost measurement (γ ``auto``,
``scheduled``, automatic tree sizes), and under pipeline parallelism a drafter that reads
intermediate layers another rank holds.

The tree mask and per-node RoPE (``cache.tree_attention``) still apply in a sharded model: the
sharded attention keeps its ``rope`` module and builds its mask from the layer caches, which are the
wrapped ones; a pipeline stage's caches are its own layers' (``make_prompt_cache`` over
``model.layers``, which mlx-lm limits to the stage's layers).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

SHARD_KINDS = ("tensor", "pipeline")


@dataclass(frozen=True)
class Sharding:
    """How a loaded target is split.

    Attributes:
        kind: ``"tensor"`` or ``"pipeline"``.
        group: The ``mx.distributed.Group`` of the ranks that share it.
    """

    kind: str
    group: object

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def launched() -> bool:
    """Whether this process was started by ``mlx.launch`` (or ``mpirun``) as one of several ranks."""
    return any(os.environ.get(k) for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def refuse_launched(command: str, why: str, instead: str) -> None:
    """Refuse a command that cannot run as one rank of an ``mlx.launch`` job (``chat``, ``bench``).

    Raises:
        ValueError: started by ``mlx.launch``: says ``why`` and what to use ``instead``.
    """
    if launched():
        raise ValueError(f"mlxspec {command} does not run under mlx.launch ({why}); {instead} (docs/distributed.md)")


def init_group():
    """``mx.distributed.init()`` for a job started by ``mlx.launch``.

    Raises:
        ValueError: not started by ``mlx.launch`` (one process cannot shard a model), or a group of one.
    """
    if not launched():
        raise ValueError("--shard needs several processes: start the command with mlx.launch, e.g. "
                         "mlx.launch --backend ring --hosts 127.0.0.1,127.0.0.1 -- mlxspec generate|serve --shard tensor ...")
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise ValueError(f"MLX's distributed backend did not start ({str(e).strip()}); check the hostfile and that "
                         "every host can reach the others (docs/distributed.md)") from e
    if group.size() < 2:
        raise ValueError("--shard needs at least two ranks; mlx.launch started one")
    return group


def shard(model: nn.Module, kind: str, group) -> Sharding:
    """Split ``model`` over ``group`` with mlx-lm's own sharding, in place, and evaluate its weights.

    Given unevaluated weights (``loading.models.load(lazy=True)``), a rank reads and decodes only what its share
    needs, one parameter at a time: its peak memory is its share plus one whole tensor for a moment.

    Args:
        model: A whole mlx-lm model, its weights evaluated or not (every rank loaded the same weights).
        kind: ``"tensor"`` (``model.shard``) or ``"pipeline"`` (``model.model.pipeline``).
        group: An ``mx.distributed.Group`` of at least two ranks.

    Returns:
        Sharding: also kept as ``model.sharding`` (``sharding(model)`` reads it).

    Raises:
        ValueError: an unknown kind; a model mlx-lm cannot split that way (naming the other way); head
            counts or widths that do not divide by the number of ranks; more ranks than layers; weights
            that cannot be read (a lazily loaded file).
    """
    if kind not in SHARD_KINDS:
        raise ValueError(f"unknown --shard {kind!r}; choose one of {', '.join(SHARD_KINDS)}")
    n, name = group.size(), getattr(model, "model_type", type(model).__name__)
    body = getattr(model, "model", None)
    if kind == "tensor":
        if not hasattr(model, "shard"):
            other = " (it supports --shard pipeline)" if hasattr(body, "pipeline") else ""
            raise ValueError(f"mlx-lm cannot split a {name} model tensor-parallel{other}")
        _check_divisible(model, n, name)
        model.shard(group)
    else:
        if not hasattr(body, "pipeline"):
            other = " (it supports --shard tensor)" if hasattr(model, "shard") else ""
            raise ValueError(f"mlx-lm cannot split a {name} model into pipeline stages{other}")
        if len(body.layers) < n:
            raise ValueError(f"a {len(body.layers)}-layer model cannot be split into {n} pipeline stages; use fewer ranks")
        body.pipeline(group)
    try:
        for _, weight in tree_flatten(model.parameters()):  # one at a time: one whole tensor decoded at once
            mx.eval(weight)
    except RuntimeError as e:  # a lazily loaded file is read here
        raise ValueError(f"reading this rank's share of the weights failed ({str(e).strip()}); check that the model's "
                         "files are complete on every machine") from e
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank is ready
    result = Sharding(kind, group)
    object.__setattr__(model, "sharding", result)  # a plain attribute, not a parameter
    return result


def _check_divisible(model: nn.Module, n: int, name: str) -> None:
    """Tensor parallelism splits heads and widths evenly: refuse what does not divide by ``n``."""
    for layer in getattr(model.model, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        sizes = {"attention heads": getattr(attn, "n_heads", 0), "key/value heads": getattr(attn, "n_kv_heads", 0)}
        if mlp is not None and hasattr(mlp, "up_proj"):
            sizes["MLP width"] = mlp.up_proj.weight.shape[0]
        bad = {k: v for k, v in sizes.items() if v % n}
        if bad:
            what = ", ".join(f"{v} {k}" for k, v in bad.items())
            raise ValueError(f"this {name} model has {what}, which {n} ranks cannot split evenly; "
                             f"use a rank count that divides them, or --shard pipeline")
        return


def sharding(model: nn.Module) -> Sharding | None:
    """How ``model`` was split by ``shard``, or ``None`` for a whole model."""
    return getattr(model, "sharding", None) if isinstance(getattr(model, "sharding", None), Sharding) else None


def check_drafter(model: nn.Module, drafter) -> None:
    """Refuse, at load time, a drafter that cannot run exactly on this sharded target.

    Under pipeline parallelism a rank holds only its stage's layers, so a drafter that reads the inputs
    of chosen layers (EAGLE-3, DFlash, DSpark, MTP) would read layers another rank holds; the final
    hidden state (Medusa, EAGLE-1/2) is all-gathered to every rank and may be read.

    Raises:
        ValueError: naming the drafter and the way out (``--shard tensor``).
    """
    s = sharding(model)
    if s is None or s.kind != "pipeline":
        return
    if getattr(drafter, "needs_hidden", False) and getattr(drafter, "feature_layers", ()):
        raise ValueError(f"the {drafter.name} drafter reads the target's layers {list(drafter.feature_layers)}, which "
                         "--shard pipeline splits over the ranks; use --shard tensor (every rank sees every layer)")


def check_measured(model: nn.Module) -> None:
    """Refuse a per-machine cost measurement on a sharded target (``calibration.load_or_calibrate``).

    Each rank would time its own share and could choose another γ or tree size, and the ranks would then
    verify different drafts: their collectives would mismatch.

    Raises:
        ValueError: naming the fixed settings to pass instead.
    """
    if sharding(model) is not None:
        raise ValueError("a sharded target does not measure costs per machine (each rank could choose another γ or "
                         "tree size): pass an integer --num-draft-tokens, and a fixed tree size where the drafter "
                         "has one (e.g. eagle:total_tokens=32, suffix:nodes=16)")


def check_sharded_args(args, fixed_gamma: int, same_seed: bool = True) -> int:
    """Make a ``--shard`` command's flags the same on every rank, in place (all ranks must call it).

    γ ``auto`` becomes ``fixed_gamma`` (``check_measured`` says why); without ``--seed`` (and with
    ``same_seed``), rank 0 draws one and every rank uses it, so the drafts and the acceptance draws agree.
    A server passes ``same_seed=False``: it draws a seed per request and shares it with the request.

    Returns:
        int: This process's rank.

    Raises:
        ValueError: ``--num-draft-tokens scheduled``; not started by ``mlx.launch`` (``init_group``).
    """
    if args.num_draft_tokens == "scheduled":  # the words of pacing.AUTO and SCHEDULED (pacing imports this module)
        raise ValueError("--num-draft-tokens scheduled measures costs on each machine, which a --shard job cannot "
                         "(each rank could verify another number of tokens); pass an integer")
    if args.num_draft_tokens == "auto":
        args.num_draft_tokens = fixed_gamma
    group = init_group()
    if args.seed is None and same_seed:
        args.seed = share_json(group, random_seed() if group.rank() == 0 else None)
    return group.rank()


def random_seed() -> int:
    """A fresh ``mx.random`` seed in [0, 2**31)."""
    return int.from_bytes(os.urandom(4), "little") % 2**31


def share_json(group, value=None):
    """Rank 0's ``value`` (anything ``json`` writes) on every rank; the others pass nothing. All ranks must call it.

    Two all-sums, as mlx-lm's server shares a request: the length, then the UTF-8 bytes (rank 0 adds
    its bytes to the others' zeros). JSON, not pickle: a rank never unpickles what the network sent.
    """
    if group.rank() == 0:
        data = mx.array(np.frombuffer(json.dumps(value).encode(), dtype=np.uint8))
        mx.eval(mx.distributed.all_sum(mx.array(data.size, dtype=mx.int32), group=group, stream=mx.cpu))
        mx.eval(mx.distributed.all_sum(data, group=group, stream=mx.cpu))
        return value
    size = mx.distributed.all_sum(mx.array(0, dtype=mx.int32), group=group, stream=mx.cpu).item()
    data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=group, stream=mx.cpu)
    return json.loads(bytes(np.array(data)))


def any_rank(group, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (one all-sum); all ranks must call it."""
    return mx.distributed.all_sum(mx.array(int(flag), dtype=mx.int32), group=group, stream=mx.cpu).item() > 0


def job_sum(model: nn.Module, value: float) -> float:
    """``value`` summed over the ranks of ``model``'s job (itself for a whole model); every rank must call it."""
    s = sharding(model)
    if s is None:
        return value
    return mx.distributed.all_sum(mx.array(float(value)), group=s.group, stream=mx.cpu).item()


@contextmanager
def rank_output(rank: int):
    """A ``--shard`` command's output: rank 0 prints as usual; the other ranks print only ``mlxspec: error``
    lines. Every rank that ``mlx.launch`` stops (it sends SIGTERM to all when one rank exits) says so in one
    line and exits with status 143 (128 + SIGTERM) instead of vanishing.

    A rank that dies mid-generation breaks the ring's sockets, so the others' collectives fail with MLX's
    "connection to a peer was lost" (one ``mlxspec: error`` line) or are stopped by ``mlx.launch`` first;
    neither waits forever (tests/test_distributed.py kills a rank to check).
    """
    def stopped(signum, frame):
        print(f"mlxspec: error: rank {rank} was stopped (SIGTERM): another rank of the job ended first, and "
              "mlx.launch stops the rest; its message, or mlx.launch's warning, says which", file=sys.stderr, flush=True)
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, stopped)
    out, err = sys.stdout, sys.stderr
    if rank != 0:
        sys.stdout, sys.stderr = open(os.devnull, "w"), _ErrorsOnly(err)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if rank != 0:
            sys.stdout.close()
            sys.stderr.flush()
            sys.stdout, sys.stderr = out, err


class _ErrorsOnly:
    """A text stream that passes on only the lines that start with ``mlxspec: error``."""

    def __init__(self, inner):
        self.inner, self.line = inner, ""

    def write(self, text: str) -> int:
        self.line += text
        *lines, self.line = self.line.split("\n")
        for line in lines:
            if line.startswith("mlxspec: error"):
                self.inner.write(line + "\n")
                self.inner.flush()
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return False
