"""The drafter interface: anything that proposes tokens for the target to verify."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..core.sampling import SamplingParams
from ..core.tree import Tree, chain

#: The word that leaves a choice to this machine's measured costs: γ (``num_draft_tokens``), a tree's nodes
#: (EAGLE ``total_tokens``, suffix ``nodes``, the Medusa tree), a draft vocabulary's size. The one definition.
AUTO = "auto"


@dataclass
class Draft:
    """Proposed tokens as a tree over the root (the last committed token).

    A chain is the tree whose node ``i`` has parent ``i - 1``; tree drafters (Medusa,
    EAGLE) use the same record with branching parents.

    Attributes:
        tokens (mx.array): Drafted ids, shape [N], int32; may be lazy (the round's
            one sync evaluates it with the verification result).
        tree (Tree): Parent of each node (``-1`` for the root), topological.
        logprobs (mx.array | None): log q that each node's token was drawn from,
            shape [N, V], float32 over the target's vocabulary (for siblings drawn
            without replacement, the adjusted q). ``None`` means the proposal is
            deterministic (q one-hot on the drafted token).
        survival (mx.array | None): The drafter's estimate that each node ends on the accepted
            path, shape [N], float32 in [0, 1], NaN where it has none; ``None`` = no estimates.
            Only ``--num-draft-tokens scheduled`` reads it (``pacing.Scheduled``). In a
            sampled draft a node's estimate must not depend on its own token (only on its
            ancestors' and its q), or scheduling would bias the output (docs/acceptance.md 3.2).
    """

    tokens: mx.array
    tree: Tree
    logprobs: mx.array | None = None
    survival: mx.array | None = None

    @classmethod
    def chain(cls, tokens: mx.array | list[int], logprobs: mx.array | None = None,
              survival: mx.array | None = None) -> Draft:
        """A chain draft: each token follows the previous one."""
        tokens = mx.array(tokens, dtype=mx.int32) if isinstance(tokens, list) else tokens
        return cls(tokens, chain(tokens.shape[0]), logprobs, survival)

    @classmethod
    def empty(cls) -> Draft:
        return cls.chain([])

    @property
    def size(self) -> int:
        return self.tree.size

    def select(self, nodes: list[int]) -> Draft:
        """The sub-draft of ``nodes`` (sorted draft indices, each one's parent among them), renumbered.

        Each kept node keeps its token, q and survival, so verifying the sub-draft is as exact as
        verifying the whole one as long as sibling lists stay prefixes in draw order
        (docs/acceptance.md 3.2; ``pacing``'s scheduled verification guarantees it).

        Raises:
            ValueError: a node whose parent is not kept.
        """
        if len(nodes) == self.size:
            return self
        if not nodes:
            return Draft.empty()
        index = {node: i for i, node in enumerate(nodes)}
        parents = []
        for node in nodes:
            parent = self.tree.parents[node]
            if parent >= 0 and parent not in index:
                raise ValueError(f"draft node {node} is kept without its parent {parent}")
            parents.append(index[parent] if parent >= 0 else -1)
        rows = mx.array(nodes, dtype=mx.int32)
        take = lambda a: None if a is None else a[rows]  # noqa: E731
        return Draft(take(self.tokens), Tree(tuple(parents)), take(self.logprobs), take(self.survival))

    def with_branch(self, branch: list[int]) -> Draft:
        """This draft with the chain ``branch`` grown from the root merged in (host-side; reads ``tokens``).

        The branch follows existing nodes while their tokens match and continues as new nodes
        from the first mismatch, so siblings stay distinct and the result is still a tree with
        deterministic children (docs/acceptance.md 2.4). Only for deterministic drafts.

        Args:
            branch: Token ids [K] following the root.

        Returns:
            Draft: the merged tree (its first ``size`` nodes are this draft's, unchanged).

        Raises:
            ValueError: if this draft carries ``logprobs`` (a sampled draft).
        """
        if self.logprobs is not None:
            raise ValueError("only a deterministic draft (logprobs None) can take an extra branch")
        tokens = [int(t) for t in (self.tokens.tolist() if self.size else [])]
        parents = list(self.tree.parents)
        children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
        node = -1
        for token in branch:
            found = children.get((node, int(token)))
            if found is None:
                parents.append(node)
                tokens.append(int(token))
                found = children[(node, int(token))] = len(tokens) - 1
            node = found
        if len(tokens) == self.size:
            return self
        survival = self.survival
        if survival is not None:  # the lookup has no estimate of its own: NaN (docs/acceptance.md 3.1)
            new = mx.full((len(tokens) - self.size,), float("nan"), dtype=mx.float32)
            survival = mx.concatenate([survival.astype(mx.float32), new]) if self.size else new
        return Draft(mx.array(tokens, dtype=mx.int32), Tree(tuple(parents)), survival=survival)


@dataclass(frozen=True)
class DraftProfile:
    """What a drafter tells the pacer (``mlxspec.pacing``) about its rounds: data, no behaviour.

    Attributes:
        max_depth: The deepest a round drafts when the drafter sizes its own rounds (a tree keeps its shape, a
            block its length), or ``None`` (any γ). Default: ``None``.
        nodes: ``nodes[d - 1]`` = the most draft nodes a round of depth d sends to the target, d =
            1..max_depth (a tree verifies more than its depth), or ``None``: d, a chain. Default: ``None``.
        per_round: Whether drafting costs the same for every γ >= 1 (one forward fills a block). Default:
            ``False``.
        confidence: Whether ``propose`` stops on its own confidence (``Plan.keep_above``). Default: ``False``.
        survival: Whether drafts carry ``Draft.survival`` (what ``scheduled`` reads). Default: ``False``.
        budget: Whether each round's tree is cut to the plan's node budget (``Plan.budget``): a tree priced on
            this machine's costs. Default: ``False``.
        plain: Whether it never drafts (``--drafter none``: plain decoding through the round loop), so there
            are no draft costs to measure and no target cache to rewind. Default: ``False``.
    """

    max_depth: int | None = None
    nodes: tuple[int, ...] | None = None
    per_round: bool = False
    confidence: bool = False
    survival: bool = False
    budget: bool = False
    plain: bool = False


@dataclass(frozen=True)
class Plan:
    """One round as the pacer (``mlxspec.pacing``) plans it; the round and the drafter read it.

    Attributes:
        gamma: The depth to draft; 0 = a plain step.
        keep_above: For a drafter that stops on its confidence: ``keep_above[k - 1]`` = the least survival
            (the product of its confidences over the k tokens drafted) at which token k + 1 pays for itself;
            ``None``: draft γ. Deciding before the next token is drawn keeps the output exact
            (docs/acceptance.md 3.3).
        budget: For a priced tree: ``budget(scores, draft_s) -> m``, the nodes to keep given the candidates'
            log path probabilities best first [C] and the seconds already spent drafting; ``None``: the
            drafter's size.
        select: What to verify of the draft (``scheduled``): ``select(draft) -> Draft``. Default: all of it.
    """

    gamma: int
    keep_above: tuple[float, ...] | None = None
    budget: Callable[[np.ndarray, float], int] | None = None
    select: Callable[[Draft], Draft] = lambda draft: draft


class Drafter(ABC):
    """Proposes tokens each round; told afterwards what the target kept.

    The engine calls ``prefill`` once per prompt, then per round ``propose`` and
    ``commit``. ``history`` is always the committed sequence (prompt + output);
    its last token is the root the draft grows from. How far it drafts is the pacer's
    (``mlxspec.pacing``), told by ``profile`` and handed back in each round's ``Plan``.
    """

    name: str = "drafter"
    #: Whether ``propose`` returns lazy arrays whose work happens on the device.
    lazy: bool = False
    #: Whether drafts may branch (the target cache must then support compaction).
    makes_trees: bool = False
    #: Whether the drafter reads the target's final hidden states (head drafters).
    needs_hidden: bool = False
    #: With ``needs_hidden``: ``()`` = the final normalised hidden state (H wide); layer indices =
    #: the residual streams entering those decoder layers, concatenated (EAGLE-3: 3 H wide).
    feature_layers: tuple[int, ...] = ()
    #: What the pacer needs to know of its rounds (a subclass overrides it, or sets it per instance).
    profile: DraftProfile = DraftProfile()

    def describe(self) -> str | None:
        """What a round proposes, in words, when γ alone does not say it (a tree's shape), or ``None``."""
        return None

    def fork(self) -> Drafter | None:
        """A drafter of this kind, with the same weights and settings and its own per-generation state, for
        another row of the runner's batch (``engine.runner``); ``None`` (the default) when this kind cannot
        run beside itself: the runner then runs its generations one at a time."""
        return None

    def vocab_summary(self) -> str | None:
        """The vocabulary it drafts from, in words, when it is not the target's whole one, or ``None``."""
        return None

    def prefill(self, prompt: list[int], hidden: mx.array | None = None) -> None:
        """Take in the prompt before the first round. ``hidden``: the target's features
        (``feature_layers``) for ``prompt[:-1]``, [L - 1, F], when ``needs_hidden``. Default: nothing."""

    @abstractmethod
    def propose(self, history: list[int], num_draft_tokens: int, sampling: SamplingParams,
                plan: Plan | None = None) -> Draft:
        """Propose up to ``num_draft_tokens`` tokens after ``history``; ``plan``: the round's ``Plan`` (its
        ``keep_above`` or ``budget``, where the profile says the drafter reads them), or ``None``."""

    def commit(self, num_committed: int, accepted: list[int], hidden: mx.array | None = None) -> None:
        """After verification: ``history`` now has ``num_committed`` tokens; ``accepted``
        lists the draft nodes (0-based, root to leaf) that were kept. ``hidden``: the
        target's features (``feature_layers``) at the verified nodes, root first, [N + 1, F],
        when ``needs_hidden``. Default: nothing."""


def pending_features(pending: mx.array | None, cached: int, num_committed: int, accepted: list[int],
                     hidden: mx.array | None) -> mx.array | None:
    """A feature-reading drafter's features still to take in, after a verify forward (EAGLE, MTP, DFlash).

    Such a drafter holds the target's features of ``cached`` committed positions in its own cache and
    keeps those of later committed positions in ``pending``. The verify forward computed the features
    of the root and of every drafted node (``hidden``, root first); the root's and each accepted
    node's become committed, except those already known.

    Args:
        pending: Features not yet in the cache, [n, F], or ``None``.
        cached: Positions already in the drafter's cache.
        num_committed: Committed tokens after this round (``Drafter.commit``).
        accepted: Accepted draft nodes, root to leaf.
        hidden: The verify forward's features, [N + 1, F], or ``None`` (then nothing changes).

    Returns:
        mx.array | None: ``pending`` with the new rows appended (lazy).
    """
    if hidden is None:
        return pending
    known = cached + (0 if pending is None else pending.shape[0])
    rows = ([0] + [node + 1 for node in accepted])[: max(num_committed - 1 - known, 0)]
    if not rows:  # nothing new committed (e.g. a cost measurement's empty round)
        return pending
    new = hidden[mx.array(rows)]  # [n, F]: the root's and each accepted node's features
    return new if pending is None else mx.concatenate([pending, new])


def feature_prefill(cache: list, held: list[int], prompt: list[int], hidden: mx.array | None,
                    *, reads_next_token: bool) -> mx.array | None:
    """Start a prompt in a feature-reading drafter (EAGLE, MTP, DFlash): keep what a chat turn shares.

    The drafter's own cache holds one entry per committed position, built from the tokens ``held``;
    entries that the new ``prompt`` still agrees with stay, later ones are trimmed, and the target's
    features of the positions after them become pending (read at the next ``propose``). Entry i
    holds the feature of position i, plus, when ``reads_next_token`` (EAGLE, MTP), token i + 1; the
    last feature then always stays pending, since ``propose`` runs the drafter from it.

    Args:
        cache: The drafter's KV caches, one per layer, all at the same offset (trimmed in place).
        held: The tokens the cache entries were built from.
        prompt: The new prompt (a chat turn: the whole conversation so far).
        hidden: The target's features of ``prompt[:-1]``, [len(prompt) - 1, F], or ``None``.
        reads_next_token: Whether entry i also depends on token i + 1.

    Returns:
        mx.array | None: The pending features, [n, F], or ``None`` when every one is cached.
    """
    common = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
    keep = 0
    if hidden is not None:
        lag = 1 if reads_next_token else 0
        keep = max(0, min(cache[0].offset, common - lag, hidden.shape[0] - lag))
    for c in cache:
        c.trim(c.offset - keep)
    return hidden[keep:] if hidden is not None and hidden.shape[0] > keep else None
