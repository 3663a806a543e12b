"""EAGLE drafting: EAGLE-2 dynamic trees, EAGLE-1 static trees and chains from an EAGLE head.

Li et al. 2024, EAGLE (arXiv 2401.15077) and EAGLE-2 (arXiv 2406.16858). The head itself (config,
layers, checkpoint formats) is ``mlxspec.heads.eagle``; the static tree presets are in ``mlxspec.core.tree``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from ..core.cache import TreeRoPE
from ..heads.eagle import EagleHead, load_eagle
from ..core.taps import model_body, output_head
from ..core.tree import Tree, read_eagle_tree, tree_from_choices
from .base import AUTO, Draft, Drafter, DraftProfile, Plan, feature_prefill, pending_features
from .registry import DrafterContext, DrafterType, at_least, int_or_auto, option, register
from .ngram import lookup_continuation


# --- the drafter ---------------------------------------------------------------------------

#: EAGLE-2 defaults (docs/heads.md 4.5: the evaluation scripts' ``--total-token 60 --depth 5 --top-k 10``;
#: EAGLE's ``depth`` counts expansions, so the deepest draft node is at depth 6).
DEFAULT_DEPTH = 6
DEFAULT_TOP_K = 10
DEFAULT_TOTAL_TOKENS = 60
#: ``total_tokens="auto"``: the most nodes a round may keep, root included.
AUTO_MAX_TOTAL_TOKENS = 64


class EagleDrafter(Drafter):
    """EAGLE-2 dynamic draft trees (EAGLE-1/2 or EAGLE-3 head); ``top_k = 1`` drafts a chain.

    Li et al. 2024, EAGLE-2 (arXiv 2406.16858) section 4 (docs/heads.md 4.5): from the draft's
    output at the root, expand the ``top_k`` best frontier nodes by cumulative draft
    log-probability, ``depth - 1`` times (the frontier nodes of one step share one draft
    position and see only their ancestors), rerank all ``top_k + (depth - 1) top_k²``
    candidates and keep the best ``total_tokens - 1`` as the tree. Children are a deterministic
    function of the context (``Draft.logprobs = None``), so the engine verifies with the
    exact one-hot rule (docs/acceptance.md 2.4): distributed as the target at any temperature, and plain
    greedy decoding at temperature 0.

    The head's KV cache holds committed draft positions only (docs/heads.md 4.6): each round it takes
    in the pairs (feature of committed position m, token m + 1) it has not seen, then trims every
    speculative entry away again. A chain (``top_k = 1``) and a static tree (EAGLE-1's rank paths,
    ``tree``) stay lazy until the engine's one sync; a dynamic branching tree needs one host read
    of the chosen nodes in ``propose`` (its shape depends on draft scores, and the engine builds
    the tree mask on the host).

    Args:
        head: A loaded ``EagleHead``.
        target: The target model (its embedding, LM head and layer count).
        depth: Deepest draft node (γ); each round uses ``min(depth, num_draft_tokens)``.
        top_k: Children per expanded node and frontier width; ``1`` = a chain.
        total_tokens: Nodes per verify forward, the root included (EAGLE's ``total_token``), or
            ``"auto"``: each round keeps the number of nodes with the best predicted tokens per
            second on this machine (the plan's node budget, ``Plan.budget``; the pacer prices it on the
            target's measured verify cost), at most 64.
        tree: ``None``/``"dynamic"``, or a static tree of rank paths (EAGLE-1, docs/heads.md 4.4): a
            preset (``"eagle1_25"``), a list such as ``[[0], [1], [0, 0]]`` or a JSON file; a rank
            indexes the draft's top-k at the parent. ``top_k``/``total_tokens`` then do not apply.
        (Each default: the head's ``config.draft_tree`` entry, else EAGLE-2's ``6``, ``10``, ``60``,
        dynamic; a static tree's depth defaults to its own.)
        ngram: Also merge the n-gram prompt lookup's continuation (``NgramDrafter``, suffixes of
            1-4 tokens) into each round's tree as one more branch of at most this many tokens
            (capped by the round's depth); ``0`` = EAGLE alone. Text that repeats earlier text
            (quotes, code, lists) is where a one-layer head guesses worst and the lookup best.
            Default: the head's ``draft_tree`` entry, else ``0``.

    Raises:
        ValueError: on ``depth``, ``top_k`` < 1, ``total_tokens`` < 2 (and not ``"auto"``), or EAGLE-3
            layers the target lacks.
    """

    name = "eagle"
    makes_trees = True
    needs_hidden = True

    def __init__(
        self,
        head: EagleHead,
        target: nn.Module,
        *,
        depth: int | None = None,
        top_k: int | None = None,
        total_tokens: int | str | None = None,
        tree: str | list | None = None,
        ngram: int | None = None,
    ):
        shipped = head.config.draft_tree or {}
        self.choices = read_eagle_tree(tree if tree is not None else shipped.get("tree"))
        if self.choices is not None and depth is None:
            depth = max(map(len, self.choices))
        depth = depth if depth is not None else shipped.get("depth", DEFAULT_DEPTH)
        top_k = top_k if top_k is not None else shipped.get("top_k", DEFAULT_TOP_K)
        self.ngram = ngram if ngram is not None else shipped.get("ngram", 0)
        if self.ngram < 0:
            raise ValueError(f"the EAGLE n-gram branch needs >= 0 tokens, got {self.ngram}")
        total_tokens = (
            total_tokens if total_tokens is not None else shipped.get("total_tokens", DEFAULT_TOTAL_TOKENS)
        )
        auto = total_tokens == AUTO
        if depth < 1 or top_k < 1 or not (auto or (isinstance(total_tokens, int) and total_tokens >= 2)):
            raise ValueError(
                f"EAGLE needs depth >= 1, top_k >= 1 and total_tokens >= 2 or 'auto'; got depth {depth}, "
                f"top_k {top_k}, total_tokens {total_tokens}"
            )
        top_k = min(top_k, head.config.draft_vocab_size)
        self.head, self.depth, self.top_k = head, depth, top_k
        self.total_tokens = AUTO_MAX_TOTAL_TOKENS if auto else total_tokens
        self.priced = auto and self.choices is None  # the plan's budget sizes each tree (DraftProfile.budget)
        self._budget = None
        body = model_body(target)
        self.embed, self.lm_head = body.embed_tokens, output_head(target)
        if head.config.version == 3:
            self.feature_layers = head.config.resolved_aux_layers(len(body.layers))
            if not all(0 <= i < len(body.layers) for i in self.feature_layers):
                raise ValueError(
                    f"the EAGLE-3 head reads layers {list(self.feature_layers)} but the target has "
                    f"{len(body.layers)} decoder layers; use a head trained for this target"
                )
        # a dynamic branching tree reads its shape on the host in propose; a chain or static tree never does
        self.lazy = ((top_k == 1 and not self.priced) or self.choices is not None) and not self.ngram
        depth_max = max(self.depth, self.ngram)  # the head's depth or the n-gram branch, whichever is longer
        # survival: the path probabilities of EAGLE-2's candidates
        self.profile = DraftProfile(
            max_depth=depth_max,
            nodes=tuple(self._nodes(d) for d in range(1, depth_max + 1)),
            survival=self.choices is None,
            budget=self.priced,
        )
        self._plans: dict[int, _StaticPlan] = {}
        # draft cache entries, and the tokens they were built from
        self.cache, self._history = [KVCache()], []
        self.prefill([], None)

    def fork(self) -> EagleDrafter:
        """The same head and tree settings with a draft cache of its own."""
        twin = copy.copy(self)
        twin._plans, twin._budget = {}, None
        twin.cache, twin._history = [KVCache()], []
        twin.prefill([], None)
        return twin

    def _nodes(self, gamma: int) -> int:
        """Nodes a round of depth γ verifies at most: the chain, static tree or EAGLE-2 candidates cut to
        depth min(γ, depth) (a priced tree: one path, the least it keeps), plus the n-gram branch."""
        depth = min(gamma, self.depth)
        if self.choices is not None:
            head = sum(1 for path in self.choices if len(path) <= depth)
        elif self.top_k == 1 or self.priced:
            head = min(depth, self.total_tokens - 1)
        else:
            head = min(self.total_tokens - 1, self.top_k + (depth - 1) * self.top_k**2) if depth else 0
        return head + min(self.ngram, gamma)

    def describe(self) -> str:
        if self.choices is not None:
            shape = f"static tree of {len(self.choices)} nodes, depth {self.depth}"
        elif self.top_k == 1:
            shape = f"depth-{self.depth} chain"
        else:
            total = "sized each round" if self.priced else f"at most {self.total_tokens} nodes"
            shape = f"EAGLE-2 tree (depth {self.depth}, top-{self.top_k}, {total})"
        return shape + (f" + a {self.ngram}-token n-gram branch" if self.ngram else "")

    def prefill(self, prompt, hidden=None):
        """Keep the draft cache's entries that the new prompt shares (a chat turn), queue the rest.

        Entry i holds (feature of position i, token i + 1), so it stays valid while the prompt
        agrees with the tokens it was built from up to position i + 1."""
        self._pending = feature_prefill(self.cache, self._history, prompt, hidden, reads_next_token=True)
        self._history = prompt
        # head rows the next propose runs
        self.prefilled = 0 if self._pending is None else self._pending.shape[0]

    def commit(self, num_committed, accepted, hidden=None):
        self._pending = pending_features(self._pending, self.cache[0].offset, num_committed, accepted, hidden)

    def _step(self, features: mx.array, tokens: mx.array, mask=None, position: int | None = None) -> mx.array:
        """Draft layer over [T] nodes into the draft cache; all at ``position`` when given."""
        cache = self.cache[0]
        if position is None:
            return self.head(features[None], tokens[None], self.embed, cache=cache, mask=mask)[0]
        attention = self.head.attention
        rope = attention.rope
        attention.rope = TreeRoPE(rope, mx.full((tokens.shape[0],), position - cache.offset, dtype=mx.int32))
        try:
            return self.head(features[None], tokens[None], self.embed, cache=cache, mask=mask)[0]
        finally:
            attention.rope = rope

    def _top(self, hidden: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """Top-k draft log-probs and target ids of each row: [R, H] -> ([R, k] float32, [R, k] int32), best
        first.

        The ids come from the logits alone, so a chain (which never reads the scores) skips the
        normalisation over the vocabulary."""
        logits = self.head.logits(hidden, self.lm_head).astype(mx.float32)  # [R, V_draft]
        if k == 1:
            ids = mx.argmax(logits, axis=-1, keepdims=True)
        else:
            ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k] if k < logits.shape[-1] else \
                mx.broadcast_to(mx.arange(logits.shape[-1]), logits.shape)
            ids = mx.take_along_axis(
                ids, mx.argsort(-mx.take_along_axis(logits, ids, axis=-1), axis=-1), axis=-1
            )
        scores = mx.take_along_axis(logits, ids, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
        return scores, self.head.target_ids(ids).astype(mx.int32)

    def propose(self, history, num_draft_tokens, sampling, plan: Plan | None = None):
        self._budget = plan.budget if plan is not None and self.priced else None
        draft = self._propose(history, num_draft_tokens)
        if self.ngram and num_draft_tokens > 0:
            branch = lookup_continuation(np.asarray(history), min(self.ngram, num_draft_tokens))
            if branch.size:
                draft = draft.with_branch(branch.tolist())
        return draft

    def _propose(self, history, num_draft_tokens) -> Draft:
        depth = min(num_draft_tokens, self.depth)
        if depth < 1 or self._pending is None:
            return Draft.empty()
        n = self._pending.shape[0]
        self._history = history
        self._t0 = time.perf_counter()
        out = self._step(self._pending, mx.array(history[-n:], dtype=mx.int32))  # [n, H]
        self._pending, committed = None, self.cache[0].offset
        try:
            if self.choices is not None:
                draft = self._static(out[-1], depth, committed)
                mx.async_eval(draft.tokens)
                return draft
            scores, ids, parents = self._expand(out[-1], depth, committed)
        finally:
            self.cache[0].trim(self.cache[0].offset - committed)  # speculative entries go
        if self.top_k == 1 and self._budget is None:  # a chain: no host read needed
            size = min(depth, self.total_tokens - 1)
            tokens = ids[:size]
            mx.async_eval(tokens)
            return Draft.chain(tokens, survival=mx.exp(scores[:size]))  # cumulative: path probabilities
        return self._rerank(scores, ids, parents)

    def _static(self, root_out: mx.array, depth: int, committed: int) -> Draft:
        """EAGLE-1's static tree, level by level: the nodes of one depth that have children are fed
        together at one shared position, each seeing its ancestors; all lazy."""
        plan = self._plans.get(depth) or self._plans.setdefault(depth, _StaticPlan(self.choices, depth))
        _, ids = self._top(root_out[None], plan.root_k)
        level = ids[0][mx.array(plan.root_ranks)]  # tokens of the depth-1 nodes
        tokens, out = [level], None
        for e, step in enumerate(plan.steps, start=1):
            n = len(step.feed)
            feats = (
                mx.broadcast_to(root_out, (n, root_out.shape[-1]))
                if e == 1
                else out[mx.array(step.feat_rows)]
            )
            mask = mx.concatenate([mx.ones((n, committed), dtype=mx.bool_), mx.array(step.ancestors),
                                   mx.eye(n, dtype=mx.bool_)], axis=1)
            out = self._step(feats, level[mx.array(step.feed)], mask, position=committed + e - 1)  # [n, H]
            _, ids = self._top(out, step.k)  # [n, k]
            level = ids[mx.array(step.child_rows), mx.array(step.child_ranks)]
            tokens.append(level)
        return Draft(mx.concatenate(tokens), plan.tree)

    def _expand(self, root_out: mx.array, depth: int, committed: int):
        """The candidate list of docs/heads.md 4.5 step 3: scores [C], target ids [C], parent flat index [C]
        (-1 = root)."""
        k = self.top_k
        scores, ids = self._top(root_out[None], k)  # [1, k]
        all_scores, all_ids, all_parents = [scores[0]], [ids[0]], [mx.full((k,), -1, dtype=mx.int32)]
        front_scores, front_ids = scores[0], ids[0]  # [k]
        front_flat = mx.arange(k, dtype=mx.int32)
        front_feat = mx.broadcast_to(root_out, (k, root_out.shape[-1]))
        ancestors = mx.zeros((k, 0), dtype=mx.bool_)  # [k, speculative entries so far]
        eye = mx.eye(k, dtype=mx.bool_)
        for step in range(1, depth):
            mask = mx.concatenate([mx.ones((k, committed), dtype=mx.bool_), ancestors, eye], axis=1)
            out = self._step(front_feat, front_ids, mask, position=committed + step - 1)  # [k, H]
            child_scores, child_ids = self._top(out, k)  # [k, k]
            child_scores = (front_scores[:, None] + child_scores).reshape(-1)  # [k²], cumulative
            child_ids = child_ids.reshape(-1)
            all_scores.append(child_scores)
            all_ids.append(child_ids)
            all_parents.append(mx.repeat(front_flat, k))
            best = mx.argpartition(-child_scores, kth=k - 1)[:k] if k > 1 else mx.array([0])
            # best first, as EAGLE's topk: it orders the next block
            best = best[mx.argsort(-child_scores[best])]
            parent = best // k  # [k] frontier node each new frontier node grew from
            ancestors = mx.concatenate([ancestors[parent], eye[parent]], axis=1)
            front_scores, front_ids, front_feat = child_scores[best], child_ids[best], out[parent]
            front_flat = (k + (step - 1) * k * k + best).astype(mx.int32)
        return mx.concatenate(all_scores), mx.concatenate(all_ids), mx.concatenate(all_parents)

    def _rerank(self, scores: mx.array, ids: mx.array, parents: mx.array) -> Draft:
        """Keep the best ``total_tokens - 1`` candidates as a tree (docs/heads.md 4.5 steps 4-5)."""
        if self._budget is not None:  # sizes the tree from the scores: one host read of them
            host = np.array(scores)
            order = np.argsort(-host, kind="stable")
            keep = self._budget(host[order], time.perf_counter() - self._t0)
            chosen = mx.array(np.sort(order[:keep]).astype(np.int32))
        else:
            keep = min(self.total_tokens - 1, scores.shape[0])
            chosen = (
                mx.argpartition(-scores, kth=keep - 1)[:keep] if keep < scores.shape[0] else mx.arange(keep)
            )
            chosen = mx.sort(chosen)  # flat order puts parents before children
        mx.eval(chosen, parents, ids)
        flat_parents = np.array(parents)
        index, tree_parents, nodes = {}, [], []
        for flat in np.array(chosen).tolist():
            parent = int(flat_parents[flat])
            if parent >= 0 and parent not in index:  # a tie let a child outrank its parent
                continue
            index[flat] = len(nodes)
            tree_parents.append(index[parent] if parent >= 0 else -1)
            nodes.append(flat)
        if not nodes:  # the budget priced the round plain
            return Draft.empty()
        rows = mx.array(nodes)
        return Draft(ids[rows], Tree(tuple(tree_parents)), survival=mx.exp(scores[rows]))


@dataclass
class _Level:
    feed: list[int]  # nodes of this depth (indices within the level) that have children
    feat_rows: list[int]  # per fed node: its parent's row among the previous level's fed nodes
    ancestors: np.ndarray  # [fed, fed before]: which earlier fed entries are ancestors
    child_rows: list[int]  # per node of the next depth: its parent's row among ``feed``
    child_ranks: list[int]  # ... and its rank among the parent's top-k
    k: int


class _StaticPlan:
    """Host-side bookkeeping of a static rank-path tree (built once per depth)."""

    def __init__(self, choices: list[list[int]], depth: int):
        self.tree, _, ranks = tree_from_choices(choices, depth)
        parents, depths = np.array(self.tree.parents), self.tree.depths[1:]
        levels = [np.flatnonzero(depths == d) for d in range(1, int(depths.max(initial=0)) + 1)]
        self.root_ranks = ranks[levels[0]].tolist()
        self.root_k = max(self.root_ranks) + 1
        self.steps, fed, row = [], [], {}
        for here, below in zip(levels, levels[1:]):
            feed = sorted(set(parents[below].tolist()))
            ancestors = np.zeros((len(feed), len(fed)), dtype=bool)
            for i, node in enumerate(feed):
                a = parents[node]
                while a >= 0:
                    ancestors[i, fed.index(a)] = True
                    a = parents[a]
            feat_rows = [row.get(parents[node], 0) for node in feed]
            row = {node: i for i, node in enumerate(feed)}
            fed += feed
            child_ranks = ranks[below].tolist()
            self.steps.append(_Level([int(np.searchsorted(here, n)) for n in feed], feat_rows, ancestors,
                                     [row[parents[c]] for c in below], child_ranks, max(child_ranks) + 1))


_SHIPPED = "the shipped head's setting, else "


@dataclass(frozen=True)
class EagleOptions:
    """``--drafter eagle`` (spec ``eagle:heads=PATH,depth=4,top_k=1,ngram=6``); ``None`` = the head's
    shipped ``draft_tree`` entry, else EAGLE-2's defaults (``EagleDrafter``).

    Raises:
        ValueError, FileNotFoundError: a size below its least value, or an unknown or bad tree.
    """

    heads: str | None = option(
        None,
        "EAGLE-1/2/3 head: a folder (config.json + model.safetensors or pytorch_model.bin), a weights file, "
        "or a Hugging Face repo id",
        default_help="the head shipped in models/eagle/ for the target",
    )
    depth: int | None = option(None, "deepest EAGLE draft node (the tree's γ; --num-draft-tokens caps it)",
                               parse=int, default_help=_SHIPPED + f"{DEFAULT_DEPTH} (EAGLE-2)")
    top_k: int | None = option(None, "EAGLE children per expanded node and frontier width; 1 drafts a chain",
                               parse=int, default_help=_SHIPPED + f"{DEFAULT_TOP_K} (EAGLE-2)")
    total_tokens: int | str | None = option(
        None,
        "EAGLE tree nodes per verify forward, root included, or 'auto': each round keeps the nodes with the "
        f"best predicted tokens/s from this machine's measured verify cost (at most {AUTO_MAX_TOTAL_TOKENS})",
        parse=int_or_auto,
        default_help=_SHIPPED + f"{DEFAULT_TOTAL_TOKENS} (EAGLE-2)",
    )
    tree: str | None = option(
        None,
        "EAGLE tree: 'dynamic' (EAGLE-2), 'eagle1_25' (EAGLE-1's static tree) or a JSON file of rank paths "
        "(a rank indexes the draft's top-k at the parent)",
        default_help=_SHIPPED + "dynamic",
    )
    ngram: int | None = option(
        None,
        "also merge the n-gram prompt lookup's continuation (up to N tokens, capped by the depth) into each "
        "EAGLE tree as one more branch; 0 = EAGLE alone",
        parse=int,
        default_help=_SHIPPED + "0",
    )

    def __post_init__(self):
        for name, least in (("depth", 1), ("top_k", 1), ("total_tokens", 2), ("ngram", 0)):
            at_least(least, getattr(self, name), f"--eagle-{name.replace('_', '-')}")
        read_eagle_tree(self.tree)


def build(options: EagleOptions, context: DrafterContext) -> EagleDrafter:
    """Raises ``ValueError``/``FileNotFoundError``: no head for the target, or a head that does not fit it."""
    head = load_eagle(context.asset("eagle", options.heads), context.target)
    return EagleDrafter(head, context.target, depth=options.depth, top_k=options.top_k,
                        total_tokens=options.total_tokens, tree=options.tree,
                        ngram=options.ngram)


DRAFTER = register(DrafterType("eagle", EagleOptions, build,
                               "an EAGLE-1/2/3 head on the target's features, dynamic or static trees "
                               "(Li et al. 2024)", order=40))
