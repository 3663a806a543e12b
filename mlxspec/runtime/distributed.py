"""The ground floor of a job started by ``mlx.launch``: the ranks' group, their collectives, their output.

A sharded target (docs/distributed.md) is split by ``loading.sharded.shard`` and run by a job that
``mlxspec.sharding`` sets up; what those and the layers between them need of the ranks lives here,
below everything: whether this process is one of several ranks (``launched``), the group
(``init_group``), what every rank must agree on (``share_json``, ``any_rank``, ``job_sum``, one
``random_seed``), the record of how a model is split (``Sharding``, read with ``sharding(model)``),
and a rank's output (``rank_output``: only rank 0 prints).

Exactness. Every rank runs the whole speculative loop on the same tokens: the drafter on each rank
(it is small and unsharded, so each rank computes the same draft), the sharded verify forward (every
rank gets the same logits: an all-reduce or all-gather hands each rank the same bits), and the
acceptance draws from ``mx.random`` seeded alike on every rank. So every rank commits the same
tokens with no per-round collective of mlxspec's own. What could make ranks differ is refused when
the job is set up (``mlxspec.sharding``), or here when a cost would be measured (``check_measured``).

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
        raise ValueError(f"mlxspec {command} does not run under mlx.launch ({why}); {instead} "
                         "(docs/distributed.md)")


def init_group():
    """``mx.distributed.init()`` for a job started by ``mlx.launch``.

    Raises:
        ValueError: not started by ``mlx.launch`` (one process cannot shard a model), or a group of one.
    """
    if not launched():
        raise ValueError(
            "--shard needs several processes: start the command with mlx.launch, e.g. mlx.launch --backend "
            "ring --hosts 127.0.0.1,127.0.0.1 -- mlxspec generate|serve --shard tensor ..."
        )
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise ValueError(
            f"MLX's distributed backend did not start ({str(e).strip()}); check the hostfile and that "
            "every host can reach the others (docs/distributed.md)"
        ) from e
    if group.size() < 2:
        raise ValueError("--shard needs at least two ranks; mlx.launch started one")
    return group


def mark_sharded(model: nn.Module, split: Sharding) -> Sharding:
    """Record on ``model`` how it was split (``loading.sharded.shard`` calls it); ``sharding(model)`` reads
    it."""
    # a plain attribute: mlx's Module keeps arrays, lists and dicts as parameters, not this
    model.sharding = split
    return split


def sharding(model: nn.Module) -> Sharding | None:
    """How ``model`` was split by ``shard``, or ``None`` for a whole model."""
    return (
        getattr(model, "sharding", None) if isinstance(getattr(model, "sharding", None), Sharding) else None
    )


def check_measured(model: nn.Module) -> None:
    """Refuse a per-machine cost measurement on a sharded target (``calibration.load_or_calibrate``).

    Each rank would time its own share and could choose another γ or tree size, and the ranks would then
    verify different drafts: their collectives would mismatch.

    Raises:
        ValueError: naming the fixed settings to pass instead.
    """
    if sharding(model) is not None:
        raise ValueError(
            "a sharded target does not measure costs per machine (each rank could choose another γ or tree "
            "size): pass an integer --num-draft-tokens, and a fixed tree size where the drafter has one "
            "(e.g. eagle:total_tokens=32, suffix:nodes=16)"
        )


def random_seed() -> int:
    """A fresh ``mx.random`` seed in [0, 2**31)."""
    return int.from_bytes(os.urandom(4), "little") % 2**31


def share_json(group, value=None):
    """Rank 0's ``value`` (anything ``json`` writes) on every rank; the others pass nothing. All ranks must
    call it.

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
    """``value`` summed over the ranks of ``model``'s job (itself for a whole model); every rank must call
    it."""
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
        print(
            f"mlxspec: error: rank {rank} was stopped (SIGTERM): another rank of the job ended first, and "
            "mlx.launch stops the rest; its message, or mlx.launch's warning, says which",
            file=sys.stderr,
            flush=True,
        )
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
