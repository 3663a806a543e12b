"""Suffix decoding: draft trees of what followed the current suffix, here and in earlier outputs.

Oliaro et al. 2024, SuffixDecoding (arXiv 2411.04975). Two token stores are searched each round: the
request's own prompt + output, and a process-wide, bounded **global store** of earlier outputs
(earlier ``generate`` calls, earlier chat turns, and an optional corpus of text files). The longest
suffix of the committed tokens that occurs in a store is matched (section 4.1); the continuations of
all its occurrences form a frequency tree, whose nodes are scored by the fraction of occurrences that
continue with their path (the paper's empirical probability, section 4.2). The best-scoring nodes are
kept best first, at most ``factor`` × the match length (the paper's MAX_SPEC = α·p) and at most
``nodes``; with ``nodes="auto"`` the count is the one with the most expected tokens per second on
this machine's measured verify curve. Of the two stores' trees, the one whose kept nodes score
higher in total (the expected accepted tokens) is drafted, the longer match breaking ties.

Children are a deterministic function of the stores, so drafts carry ``logprobs = None`` and the
engine verifies them with the exact one-hot tree rule (docs/acceptance.md 2.4): the output is distributed as
the target's at any temperature, and equals plain greedy decoding at temperature 0.

The paper indexes the stores with suffix trees. The same query (every occurrence of the longest
matching suffix, and how often each continuation followed) is answered here by a vectorised
backward-extension scan over flat token arrays: appending a committed token costs O(1), a whole
document is evicted in O(1), a finished document is joined into the search array once, amortised
O(its length) (``SuffixStore``), memory is 4 bytes per stored token plus 4 to 8 for the joined search
copy (it grows by doubling), and a round costs O(L) NumPy comparisons over L stored tokens (about a
millisecond per million tokens), small beside a target forward.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..core.taps import logits_width
from ..core.tree import Tree
from .base import AUTO, Draft, Drafter, DraftProfile
from .registry import DrafterContext, DrafterType, at_least, int_or_auto, option, register
from .suffix_store import DEFAULT_STORE_TOKENS, SEPARATOR, SuffixStore, global_store, load_corpus

DEFAULT_DEPTH = 8
DEFAULT_NODES = 16
#: The paper's α in MAX_SPEC = α·p: draft nodes per matched token.
DEFAULT_FACTOR = 2.0
#: Nodes whose empirical probability is lower are not drafted (vLLM's ``min_token_prob`` default).
DEFAULT_MIN_PROB = 0.1
#: Longest suffix matched against a store.
MAX_MATCH = 32
#: Most recent occurrences whose continuations are counted.
MAX_OCCURRENCES = 256
#: Prompt tokens stored ahead of each output, so a repeated request matches from its first token.
PROMPT_CONTEXT = 32
#: ``nodes="auto"``: the most nodes a round may keep.
AUTO_MAX_NODES = 32


# --- matching and scoring ------------------------------------------------------------------


def longest_match(
    tokens: np.ndarray, pattern: np.ndarray, max_match: int = MAX_MATCH
) -> tuple[int, np.ndarray]:
    """The longest suffix of ``pattern`` that occurs in ``tokens`` with a token after it.

    Extends the match backwards one token at a time over the occurrences that are left, so the
    cost is one comparison over ``tokens`` plus a shrinking set of occurrences.

    Args:
        tokens (np.ndarray): A store, shape [L], int32; ``-1`` separates documents.
        pattern (np.ndarray): The committed tokens, shape [P], int32 (its suffix is matched).
        max_match: Longest suffix tried. Default: ``32``.

    Returns:
        tuple[int, np.ndarray]: The match length m (0 for none) and the positions in ``tokens`` of
        the last token of each occurrence, ascending, shape [occurrences], int64.
    """
    longest = min(max_match, pattern.shape[0])
    if longest == 0 or tokens.shape[0] < 2:
        return 0, np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(tokens[:-1] == pattern[-1])
    if ends.size == 0:
        return 0, ends
    m = 1
    while m < longest:
        ends_left = ends[ends >= m]
        keep = ends_left[tokens[ends_left - m] == pattern[-1 - m]]
        if keep.size == 0:
            break
        ends, m = keep, m + 1
    return m, ends


@dataclass
class ScoredTree:
    """Draft candidates best first; a node's parent always comes before it.

    Attributes:
        tokens: Node tokens [C].
        parents: Each node's parent in this numbering, ``-1`` = the root [C].
        scores: Empirical probability of each node's path, non-increasing, in (0, 1] [C].
        match_length: Tokens of the suffix that matched.
    """

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    match_length: int


def continuation_tree(tokens: np.ndarray, ends: np.ndarray, match_length: int, depth: int,
                      min_prob: float = DEFAULT_MIN_PROB, max_nodes: int = AUTO_MAX_NODES) -> ScoredTree:
    """The frequency tree of what followed the occurrences ``ends``, best nodes first.

    SuffixDecoding (arXiv 2411.04975) section 4.2: a node's score is the product of
    count(child) / count(parent) along its path, i.e. the fraction of the (most recent
    ``MAX_OCCURRENCES``) occurrences that continue with the path. Nodes are taken greedily by
    score (a heap over the frontier), so every kept node's parent is kept before it.

    Args:
        tokens (np.ndarray): The store, shape [L], int32; ``-1`` ends a continuation.
        ends (np.ndarray): Positions of the matched suffix's last token (``longest_match``).
        match_length: Recorded in the result.
        depth: Deepest node (tokens of continuation).
        min_prob: Nodes scoring less are dropped. Default: ``0.1``.
        max_nodes: Most candidates returned. Default: ``32``.

    Returns:
        ScoredTree: Up to ``max_nodes`` candidates (none when ``ends`` is empty).
    """
    ends = ends[-MAX_OCCURRENCES:]
    counts, node_token, node_parent, node_depth, kids = [len(ends)], [-1], [-1], [0], {}
    for end in ends.tolist():
        node = 0
        for token in tokens[end + 1 : end + 1 + depth].tolist():
            if token == SEPARATOR:
                break
            child = kids.get((node, token))
            if child is None:
                child = kids[(node, token)] = len(counts)
                counts.append(0)
                node_token.append(token)
                node_parent.append(node)
                node_depth.append(node_depth[node] + 1)
            counts[child] += 1
            node = child
    children: dict[int, list[int]] = {}
    for (parent, _), child in kids.items():
        children.setdefault(parent, []).append(child)
    out, index = ScoredTree([], [], [], match_length), {0: -1}
    frontier = [(-counts[c], node_depth[c], c) for c in children.get(0, [])]
    while frontier and len(out.tokens) < max_nodes:
        frontier.sort()  # a handful of entries: cheaper than a heap's bookkeeping
        negative, _, node = frontier.pop(0)
        score = -negative / counts[0]
        if score < min_prob:
            break
        index[node] = len(out.tokens)
        out.tokens.append(node_token[node])
        out.parents.append(index[node_parent[node]])
        out.scores.append(score)
        frontier += [(-counts[c], node_depth[c], c) for c in children.get(node, [])]
    return out


# --- the drafter ---------------------------------------------------------------------------


class SuffixDrafter(Drafter):
    """SuffixDecoding drafter (Oliaro et al. 2024, arXiv 2411.04975; see the module docstring).

    Args:
        store: The global ``SuffixStore`` to read and feed, or ``None`` (this request only).
        depth: Deepest draft node; a round uses ``min(depth, num_draft_tokens)``. Default: ``8``.
        nodes: Most draft nodes per round, or ``"auto"``: the count with the most expected tokens
            per second on ``costs`` (at most 32). Default: ``16``.
        factor: Draft nodes per matched token (the paper's α). Default: ``2.0``.
        min_prob: Least empirical path probability drafted. Default: ``0.1``.
        vocab_size: The target's logits width (recorded; the store is keyed by it). Default: none.
    """

    name = "suffix"
    makes_trees = True

    def __init__(self, store: SuffixStore | None = None, *, depth: int = DEFAULT_DEPTH,
                 nodes: int | str = DEFAULT_NODES, factor: float = DEFAULT_FACTOR,
                 min_prob: float = DEFAULT_MIN_PROB, vocab_size: int | None = None):
        self.store, self.depth, self.nodes, self.factor, self.min_prob = store, depth, nodes, factor, min_prob
        self.vocab_size = vocab_size
        self.document: int | None = None
        self._recorded, self._drafted = 0, []

    @property
    def profile(self) -> DraftProfile:
        """Its depth; with ``nodes="auto"`` each round's tree is cut to the plan's budget
        (``Plan.budget``)."""
        return DraftProfile(max_depth=self.depth, budget=self.nodes == AUTO,
                            nodes=(AUTO_MAX_NODES,) * self.depth if self.nodes == AUTO else None)

    def fork(self) -> SuffixDrafter:
        """The same settings and the same store of earlier answers (every row reads and feeds it)."""
        twin = copy.copy(self)
        twin.document, twin._recorded, twin._drafted = None, 0, []
        return twin

    def prefill(self, prompt, hidden=None):
        self.document = (
            self.store.open(self, list(prompt[-PROMPT_CONTEXT:])) if self.store is not None else None
        )
        self._recorded, self._drafted = len(prompt), []

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        if self.document is not None and len(history) > self._recorded:
            self.store.append(self.document, list(history[self._recorded :]))  # the last round's target token
            self._recorded = len(history)
        depth = min(self.depth, num_draft_tokens)
        if depth < 1:
            return Draft.empty()
        own = np.asarray(history, dtype=np.int32)
        stores = [own] + ([self.store.searchable(exclude=self.document)] if self.store is not None else [])
        trees = [self._candidates(tokens, own, depth) for tokens in stores]
        budget = plan.budget if plan is not None else None
        trees = [(tree, self._budget(tree, budget)) for tree in trees]
        best, keep = max(trees, key=lambda t: (sum(t[0].scores[: t[1]]), t[0].match_length))
        self._drafted = best.tokens[:keep]
        if keep == 0:
            return Draft.empty()
        return Draft(mx.array(best.tokens[:keep], dtype=mx.int32), Tree(tuple(best.parents[:keep])))

    def commit(self, num_committed, accepted, hidden=None):
        if self.document is None or not accepted or num_committed < self._recorded + len(accepted):
            return
        self.store.append(self.document, [self._drafted[node] for node in accepted])
        self._recorded += len(accepted)

    def _candidates(self, tokens: np.ndarray, history: np.ndarray, depth: int) -> ScoredTree:
        length, ends = longest_match(tokens, history)
        limit = AUTO_MAX_NODES if self.nodes == AUTO else self.nodes
        return continuation_tree(tokens, ends, length, depth, self.min_prob, limit)

    def _budget(self, tree: ScoredTree, budget) -> int:
        if not tree.tokens:
            return 0
        by_match = max(1, math.ceil(self.factor * tree.match_length))
        if budget is not None:  # the scores are path probabilities, best first
            return min(by_match, budget(np.log(np.maximum(tree.scores, 1e-30)), 0.0))
        return min(by_match, len(tree.tokens))


@dataclass(frozen=True)
class SuffixOptions:
    """``--drafter suffix`` (spec ``suffix:depth=8,nodes=16,shared=false``).

    Raises:
        ValueError: on ``depth``, ``nodes`` or ``store_tokens`` < 1, ``factor`` <= 0, or ``min_prob``
            outside [0, 1), naming the flag.
    """

    depth: int = option(DEFAULT_DEPTH, "deepest node the suffix drafter drafts", parse=int)
    nodes: int | str = option(
        DEFAULT_NODES,
        "most draft nodes per round, or 'auto': the count with the most expected tokens per second from this "
        "machine's measured verify costs",
        parse=int_or_auto,
    )
    factor: float = option(
        DEFAULT_FACTOR, "draft nodes per matched suffix token (SuffixDecoding's alpha)", parse=float
    )
    min_prob: float = option(DEFAULT_MIN_PROB, "least empirical probability of a drafted path", parse=float)
    shared: bool = option(True, "read and feed the process-wide store of earlier outputs ('false': this "
                          "request only)", parse=lambda text: _boolean(text, "--suffix-shared"))
    store_tokens: int = option(
        DEFAULT_STORE_TOKENS,
        "tokens the process-wide store keeps before evicting its oldest documents (4-8 bytes each)",
        parse=int,
    )
    corpus: str | None = option(
        None,
        "a text file or folder (e.g. a source tree) added to the process-wide store",
        default_help="none",
    )

    def __post_init__(self):
        at_least(1, self.depth, "--suffix-depth")
        at_least(1, self.nodes, "--suffix-nodes")
        at_least(1, self.store_tokens, "--suffix-store-tokens")
        if not self.factor > 0:
            raise ValueError(f"--suffix-factor must be > 0, got {self.factor}")
        if not 0 <= self.min_prob < 1:
            raise ValueError(f"--suffix-min-prob must be in [0, 1), got {self.min_prob}")
        if self.corpus is not None and not self.shared:
            raise ValueError("--suffix-corpus goes into the shared store; drop it or --suffix-shared false")


def _boolean(text: str, flag: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
        text.strip().lower()
    )
    if value is None:
        raise ValueError(f"{flag} takes true or false, got {text!r}")
    return value


def build(options: SuffixOptions, context: DrafterContext) -> SuffixDrafter:
    """Raises ``ValueError``: a corpus that cannot be read."""
    vocab_size = logits_width(context.target) if context.target is not None else None
    store = None
    if options.shared:
        store = global_store((vocab_size, context.target_name), options.store_tokens)
        if options.corpus is not None:
            load_corpus(store, options.corpus, context.tokenizer, vocab_size)
    return SuffixDrafter(store, depth=options.depth, nodes=options.nodes, factor=options.factor,
                         min_prob=options.min_prob, vocab_size=vocab_size)


DRAFTER = register(
    DrafterType(
        "suffix",
        SuffixOptions,
        build,
        "SuffixDecoding: frequency-scored trees of what followed the current suffix in this request and in "
        "earlier outputs of the process; no model (Oliaro et al. 2024)",
        order=25,
    )
)
