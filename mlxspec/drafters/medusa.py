"""Medusa drafting: a static tree of top-k guesses from K extra decoding heads.

Cai et al. 2024, "Medusa" (arXiv 2401.10774), sections 2.1 (heads) and 2.3 (tree
attention). Each round the heads' (``mlxspec.heads.medusa``) top-k tokens fill a static
tree of rank paths (``mlxspec.core.tree``); the drafts are deterministic, so verification is the exact
tree rule for one-hot q (docs/acceptance.md 2.4) and the output is distributed as the target's.

The default tree, ``auto``, is ``mc_sim_7b_63`` cut each round to the node budget of the round's plan
(``Plan.budget``: the pacer prices it on this machine's measured verify cost, as EAGLE-2 sizes its trees,
and may keep none, a plain step); the pacer (``mlxspec.pacing``) also rests the heads after rounds it
priced plain and never runs them where no tree could win.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..heads.medusa import MedusaHeads, load_medusa, medusa_folder
from ..core.sampling import SamplingParams
from ..core.taps import logits_width, output_head
from ..core.tree import MC_SIM_7B_63, TREE_PRESETS, Tree, read_tree, tree_from_choices
from .base import AUTO, Draft, Drafter, DraftProfile, Plan
from .registry import DrafterContext, DrafterType, option, register



class MedusaDrafter(Drafter):
    """Proposes the static Medusa tree from the heads' top-k at the last verified position.

    Args:
        heads: Loaded ``MedusaHeads``.
        lm_head: The target's LM head (``taps.output_head(target)``).
        choices: Rank paths of the tree. Default: ``mc_sim_7b_63``.
        priced: Whether each round keeps the nodes the plan's budget says (``DraftProfile.budget``; the path
            probabilities are read on the host once); otherwise the whole tree is verified, with no host read.
            Default: ``False``.
    """

    name = "medusa"
    lazy = True
    makes_trees = True
    needs_hidden = True

    def __init__(
        self, heads: MedusaHeads, lm_head, choices: list[list[int]] | None = None, *, priced: bool = False
    ):
        self.heads, self.lm_head = heads, lm_head
        choices = choices if choices is not None else MC_SIM_7B_63
        # a rank at or past the vocabulary has no token (tiny vocabularies); prefixes of kept paths stay
        self.choices = [c for c in choices if max(c) < heads.config.vocab_size]
        self.priced = priced
        self.lazy = not priced  # a priced tree reads its nodes' scores on the host
        self._trees: dict[int, tuple[Tree, mx.array, mx.array, int]] = {}
        self._hidden = None  # [H]: hidden state at the position before the root
        depth = min(max(map(len, self.choices), default=0), heads.config.medusa_num_heads)
        # survival: the heads' probabilities of each node's token, multiplied along its path
        self.profile = DraftProfile(
            max_depth=depth,
            nodes=tuple(self._tree(d)[0].size for d in range(1, depth + 1)),
            survival=True,
            budget=priced,
        )

    def describe(self) -> str:
        size = len(self.choices)
        preset = next(
            (name for name, choices in TREE_PRESETS.items() if choices == self.choices), "from a file"
        )
        priced = ", the nodes this machine's verify cost pays for, each round" if self.priced else ""
        return f"tree {preset} ({size} nodes, depth {self.profile.max_depth}{priced})"

    def _tree(self, depth: int):
        if depth not in self._trees:
            tree, heads, ranks = tree_from_choices(self.choices, depth)
            top_k = int(ranks.max()) + 1 if tree.size else 0
            # [N, N]: a node and its ancestors
            ancestors = mx.array(tree.ancestor_mask[1:, 1:].astype("float32"))
            self._trees[depth] = (tree, mx.array(heads), mx.array(ranks), top_k, ancestors)
        return self._trees[depth]

    def prefill(self, prompt, hidden=None):
        self._hidden = None if hidden is None or hidden.shape[0] == 0 else hidden[-1]

    def propose(self, history, num_draft_tokens, sampling: SamplingParams, plan: Plan | None = None):
        depth = min(num_draft_tokens, self.heads.config.medusa_num_heads)
        if self._hidden is None or depth < 1:
            return Draft.empty()
        start = time.perf_counter()
        tree, node_heads, node_ranks, top_k, ancestors = self._tree(depth)
        logits = self.heads(self._hidden[None], self.lm_head)[:depth, 0]  # [depth, V]
        best = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k]  # [depth, top_k], unordered
        order = mx.argsort(-mx.take_along_axis(logits, best, axis=-1), axis=-1)
        ranked = mx.take_along_axis(best, order, axis=-1)  # [depth, top_k]: rank 0 = most likely
        tokens = ranked[node_heads, node_ranks].astype(mx.int32)
        mx.async_eval(tokens)
        logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        node_logprobs = mx.take_along_axis(logprobs, ranked, axis=-1)[node_heads, node_ranks]  # [N]
        scores = ancestors @ node_logprobs  # [N]: log path probabilities
        if plan is None or plan.budget is None:
            return Draft(tokens, tree, survival=mx.exp(scores))
        return self._priced(tree, tokens, scores, plan.budget, start)

    def _priced(self, tree: Tree, tokens: mx.array, scores: mx.array, budget, start: float) -> Draft:
        """The subtree of the nodes the plan's budget keeps (the best path probabilities, parents first)."""
        host = np.array(scores.astype(mx.float32))
        order = np.argsort(-host, kind="stable")  # a parent scores at least its child and comes first
        keep = budget(host[order], time.perf_counter() - start)
        index, nodes, parents = {}, [], []
        for node in np.sort(order[:keep]).tolist():
            parent = tree.parents[node]
            if parent >= 0 and parent not in index:  # rounding let a child outscore its parent
                continue
            index[node] = len(nodes)
            nodes.append(node)
            parents.append(index[parent] if parent >= 0 else -1)
        if not nodes:
            return Draft.empty()
        rows = mx.array(nodes)
        return Draft(tokens[rows], Tree(tuple(parents)), survival=mx.exp(scores[rows]))

    def commit(self, num_committed, accepted, hidden=None):
        if hidden is not None:
            self._hidden = hidden[accepted[-1] + 1 if accepted else 0]


@dataclass(frozen=True)
class MedusaOptions:
    """``--drafter medusa`` (spec ``medusa:heads=PATH,tree=small_15``).

    Raises:
        ValueError, FileNotFoundError: an unknown tree preset or a bad tree file.
    """

    heads: str | None = option(
        None,
        "Medusa heads: a folder, a medusa_lm_head.safetensors/.pt file, or a Hugging Face repo id",
        default_help="the heads shipped in models/medusa/ for the target",
    )
    tree: str = option(
        AUTO,
        f"Medusa tree: 'auto' (mc_sim_7b_63, keeping each round the nodes this machine's measured verify "
        f"cost pays for, none when plain decoding is faster), a preset ({', '.join(TREE_PRESETS)}) verified "
        f"whole, or a JSON file of rank paths",
    )

    def __post_init__(self):
        if self.tree != AUTO:
            read_tree(self.tree)


def build(options: MedusaOptions, context: DrafterContext) -> MedusaDrafter:
    """Raises ``ValueError``/``FileNotFoundError``: no heads for the target, or heads that do not fit it."""
    path = context.asset("medusa", options.heads and str(medusa_folder(options.heads)))
    target = context.target
    heads = load_medusa(path, hidden_size=target.args.hidden_size, vocab_size=logits_width(target))
    if options.tree == AUTO:
        return MedusaDrafter(heads, output_head(target), MC_SIM_7B_63, priced=True)
    return MedusaDrafter(heads, output_head(target), read_tree(options.tree))


DRAFTER = register(
    DrafterType(
        "medusa",
        MedusaOptions,
        build,
        "Medusa heads on the target's last hidden state, a static tree (Cai et al. 2024)",
        order=30,
    )
)
