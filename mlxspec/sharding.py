"""A sharded job (``--shard``, docs/distributed.md): what the ranks of an ``mlx.launch`` job agree on, and the
refusals they print once.

It sits above the layers it composes: the model's split (``loading.sharded``), the drafter's declared needs
(``Drafter.needs_hidden``, ``feature_layers``), the pacer's words (``pacing.AUTO``) and the engine's fixed γ.
A command passes what a job needs (``start``) and reads back the γ and seed every rank uses (``Job``); its
parsed flags stay as the user gave them.

Refusals are printed once. Every rank runs the same checks on the same inputs, so a job that cannot work
fails on every rank alike: ``together`` runs such a step on every rank, agrees on the outcome with one
collective, and lets only one rank say why (rank 0, or the lowest rank that failed alone), before any rank
exits. Under ``mlx.launch`` without ``--shard``, ``generate`` and ``serve`` are refused the same way
(``refuse_unsharded``): each rank would run the whole model and print or serve the same answer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import mlx.core as mx

from .drafters import Drafter
from .engine.generate import DEFAULT_NUM_DRAFT_TOKENS
from .engine.session import USER_ERRORS
from .loading.sharded import SHARD_KINDS, check_shardable, split_problem
from .pacing import AUTO, SCHEDULED
from .runtime.distributed import init_group, launched, random_seed, share_json, sharding

__all__ = ["SHARD_KINDS", "Job", "check_drafter", "refuse_unsharded", "start", "together"]

T = TypeVar("T")


@dataclass(frozen=True)
class Job:
    """What every rank of a sharded job runs with.

    Attributes:
        kind: ``"tensor"`` or ``"pipeline"``.
        group: The ``mx.distributed.Group`` of the job's ranks.
        num_draft_tokens: γ: the flag's integer, or for ``auto`` the fixed ``DEFAULT_NUM_DRAFT_TOKENS`` (costs
            are not measured per rank: each rank could choose another γ).
        seed: The flag's seed; without one (and with ``same_seed``), one drawn by rank 0 and shared; else
            ``None``.
    """

    kind: str
    group: object
    num_draft_tokens: int
    seed: int | None

    @property
    def rank(self) -> int:
        return self.group.rank()


def start(
    kind: str, model: str, num_draft_tokens: int | str, seed: int | None, *, same_seed: bool = True
) -> Job:
    """Start a sharded job: join the ranks, refuse what cannot work before any rank reads weights, agree on γ
    and the seed. Every rank must call it.

    Args:
        kind: ``--shard``: ``"tensor"`` or ``"pipeline"``.
        model: ``--model``'s spec (its config is read, not its weights).
        num_draft_tokens: ``--num-draft-tokens``: an integer or ``auto``.
        seed: ``--seed``, or ``None``.
        same_seed: Without ``seed``, rank 0 draws one for every rank. A server passes ``False``: it draws a
            seed per request and shares it with the request. Default: ``True``.

    Returns:
        Job: the group, γ and seed every rank uses.

    Raises:
        ValueError: not started by ``mlx.launch`` (``distributed.init_group``).
        SystemExit: status 2 after the refusal was printed once: ``--num-draft-tokens scheduled``, or a split
            mlx-lm cannot make for this model and this many ranks (``loading.sharded.check_split``).
    """
    group = init_group()
    together(group, lambda: _check_start(kind, model, num_draft_tokens, group.size()))
    gamma = DEFAULT_NUM_DRAFT_TOKENS if num_draft_tokens == AUTO else num_draft_tokens
    if seed is None and same_seed:
        seed = share_json(group, random_seed() if group.rank() == 0 else None)
    return Job(kind, group, gamma, seed)


def _check_start(kind: str, model: str, num_draft_tokens: int | str, ranks: int) -> None:
    if num_draft_tokens == SCHEDULED:
        raise ValueError(
            "--num-draft-tokens scheduled measures costs on each machine, which a --shard job cannot (each "
            "rank could verify another number of tokens); pass an integer"
        )
    check_shardable(model, kind, ranks)


def check_drafter(model, drafter: Drafter) -> None:
    """Refuse, at load time, a drafter that cannot run exactly on this sharded target (a whole one serves
    all).

    Under pipeline parallelism a rank holds only its stage's layers, so a drafter that reads the inputs of
    chosen layers (its declared ``feature_layers``: EAGLE-3, DFlash, DSpark, MTP) would read layers another
    rank holds; the final hidden state (Medusa, EAGLE-1/2) is all-gathered to every rank and may be read.

    Raises:
        ValueError: naming the drafter and a way out that works for this model.
    """
    split = sharding(model)
    if split is None or split.kind != "pipeline" or not (drafter.needs_hidden and drafter.feature_layers):
        return
    fix = (
        "use --shard tensor (every rank sees every layer)"
        if split_problem(model, "tensor", split.size) is None
        else "use a drafter that reads no inner layer (ngram, suffix, draft, medusa, EAGLE-1/2)"
    )
    raise ValueError(
        f"the {drafter.name} drafter reads the target's layers {list(drafter.feature_layers)}, which --shard "
        f"pipeline splits over the ranks; {fix}"
    )


def together(group, step: Callable[[], T]) -> T:
    """Run ``step`` on every rank of ``group`` and agree on its outcome; every rank must call it.

    When ``step`` raised a user error (``session.USER_ERRORS``) on some rank, one rank prints it as
    ``mlxspec: error: ...`` (rank 0 when it failed, else the lowest rank that did, naming itself), every rank
    waits until it has, and every rank exits with status 2. ``step`` must not run collectives of its own.

    Returns:
        ``step``'s result, on every rank, when no rank failed.

    Raises:
        SystemExit: status 2, on every rank, when ``step`` failed on any.
    """
    problem, result = None, None
    try:
        result = step()
    except USER_ERRORS as e:
        problem = str(e)
    rank, size = group.rank(), group.size()
    failed = mx.distributed.all_sum(mx.array([int(problem is not None and r == rank) for r in range(size)]),
                                    group=group, stream=mx.cpu).tolist()  # [size]: which ranks failed
    if not any(failed):
        return result
    if rank == failed.index(1):
        where = "" if rank == 0 else f"rank {rank}: "
        print(f"mlxspec: error: {where}{problem}", file=sys.stderr, flush=True)
    # it has printed: now all may exit
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))
    raise SystemExit(2)


def refuse_unsharded(command: str) -> None:
    """Under ``mlx.launch`` (two or more ranks) without ``--shard``: refuse, printed once (rank 0).

    Every rank would load the whole model and run the same request, printing (or serving) it once per rank.
    A launch of one rank, or a stray ``MLX_RANK`` without a launcher, runs as one process.

    Raises:
        SystemExit: status 2, on every rank, after rank 0 said what to pass.
    """
    if not launched():
        return
    group = mx.distributed.init()  # a group of one when no launcher started this process
    if group.size() < 2:
        return

    def refuse() -> None:
        raise ValueError(
            f"mlxspec {command} under mlx.launch needs --shard tensor or --shard pipeline (without it each "
            f"of the {group.size()} ranks would run the whole model and answer once); add --shard, "
            "or run it without mlx.launch"
        )

    together(group, refuse)
