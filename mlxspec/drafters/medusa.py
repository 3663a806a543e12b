"""Medusa drafting: a static tree of top-k guesses from K extra decoding heads.

Cai et al. 2024, "Medusa" (arXiv 2401.10774), sections 2.1 (heads) and 2.3 (tree
attention). Each round the heads' (``mlxspec.heads.medusa``) top-k tokens fill a static
tree of rank paths (``mlxspec.tree``); the drafts are deterministic, so verification is the exact
tree rule for one-hot q (docs/acceptance.md 2.4) and the output is distributed as the target's.

The default tree, ``auto``, is ``mc_sim_7b_63`` priced each round by this machine's measured verify
cost (``costmodel.TreeBudget``, as EAGLE-2 sizes its trees): it keeps the nodes whose path
probabilities pay for their verify width, and drafts nothing (a plain step) when none do, so on a
machine where verifying 64 tokens costs several steps it verifies a few nodes or none. Where even a
perfect tree could not pay for the heads' run plus its verify (``TreeBudget.can_win``), the tree is
priced as plain once, at load time, and the heads never run. The budget can only say "plain" after the
heads have run, so a run of rounds it prices as plain stops running them for a while (16 rounds, then
twice as long after each further plain-priced probe, up to 256; a kept tree resets it), as γ auto backs
off a drafter that keeps missing: a round with no tree costs a plain step, not the heads as well.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..costmodel import TreeBudget
from ..heads.medusa import MedusaHeads, load_medusa, medusa_folder
from ..sampling import SamplingParams
from ..taps import logits_width, output_head
from ..tree import MC_SIM_7B_63, TREE_PRESETS, Tree, read_tree, tree_from_choices
from .base import Draft, Drafter
from .registry import DrafterContext, DrafterType, option, register

#: ``--medusa-tree auto`` (the default): ``mc_sim_7b_63`` pruned each round by the measured verify cost.
AUTO_TREE = "auto"


class MedusaDrafter(Drafter):
    """Proposes the static Medusa tree from the heads' top-k at the last verified position.

    Args:
        heads: Loaded ``MedusaHeads``.
        lm_head: The target's LM head (``taps.output_head(target)``).
        choices: Rank paths of the tree. Default: ``mc_sim_7b_63``.
        costs: ``costmodel.Costs`` of the target on this machine (or a function returning them):
            each round keeps the nodes with the best predicted tokens per second (``TreeBudget``,
            which may keep none: a plain step), reading the nodes' path probabilities on the host
            once. ``None`` verifies the whole tree every round, with no host read. Default: ``None``.

    Attributes:
        priced_plain: Whether the priced tree can never beat a plain step on this machine (the heads'
            measured run plus any tree's verify costs more than the tokens it could add): every round is
            then a plain step, and the heads are not run.
    """

    name = "medusa"
    #: Rounds in a row the budget prices as plain before the heads rest, and the first and longest rests.
    PLAIN_RUN, FIRST_WAIT, MAX_WAIT = 2, 16, 256
    lazy = True
    makes_trees = True
    needs_hidden = True
    reports_survival = True  # the heads' probabilities of each node's token, multiplied along its path

    def __init__(self, heads: MedusaHeads, lm_head, choices: list[list[int]] | None = None, costs=None):
        self.heads, self.lm_head = heads, lm_head
        choices = choices if choices is not None else MC_SIM_7B_63
        # a rank at or past the vocabulary has no token (tiny vocabularies); prefixes of kept paths stay
        self.choices = [c for c in choices if max(c) < heads.config.vocab_size]
        costs = costs() if callable(costs) else costs
        self.budget = TreeBudget(costs, max_nodes=len(self.choices), allow_plain=True) if costs is not None else None
        self.lazy = self.budget is None  # a priced tree reads its nodes' scores on the host
        self.priced_plain = self.budget is not None and not self.budget.can_win(self.tree_depth, self._heads_s())
        self._trees: dict[int, tuple[Tree, mx.array, mx.array, int]] = {}
        self._hidden = None  # [H]: hidden state at the position before the root
        # the budget's back-off: plain-priced rounds in a row, rounds left to skip the heads, the next wait
        self._plain_run, self._skip, self._wait = 0, 0, self.FIRST_WAIT

    @property
    def tree_depth(self) -> int:
        """The tree's depth, capped by the number of heads."""
        return min(max(map(len, self.choices), default=0), self.heads.config.medusa_num_heads)

    def _heads_s(self) -> float:
        """Seconds of one run of the heads, the least a round's drafting costs (best of 2 after a warm-up)."""
        dtype = tree_flatten(self.heads.parameters())[0][1].dtype
        hidden = mx.zeros((1, self.heads.config.hidden_size), dtype=dtype)  # [1, H]
        times = []
        for _ in range(3):
            start = time.perf_counter()
            mx.eval(self.heads(hidden, self.lm_head))
            times.append(time.perf_counter() - start)
        return min(times[1:])

    def _tree(self, depth: int):
        if depth not in self._trees:
            tree, heads, ranks = tree_from_choices(self.choices, depth)
            top_k = int(ranks.max()) + 1 if tree.size else 0
            ancestors = mx.array(tree.ancestor_mask[1:, 1:].astype("float32"))  # [N, N]: a node and its ancestors
            self._trees[depth] = (tree, mx.array(heads), mx.array(ranks), top_k, ancestors)
        return self._trees[depth]

    def round_nodes(self, gamma: int) -> int:
        """Nodes of the tree cut to depth min(γ, heads) (a budgeted tree prices its own rounds)."""
        depth = min(gamma, self.heads.config.medusa_num_heads)
        return self._tree(depth)[0].size if depth >= 1 else 0

    def prefill(self, prompt, hidden=None):
        self._hidden = None if hidden is None or hidden.shape[0] == 0 else hidden[-1]

    def propose(self, history, num_draft_tokens, sampling: SamplingParams):
        depth = min(num_draft_tokens, self.heads.config.medusa_num_heads)
        if self.priced_plain or self._hidden is None or depth < 1:
            return Draft.empty()
        if self._skip > 0:  # the budget priced the last rounds as plain: the heads rest (a plain step)
            self._skip -= 1
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
        if self.budget is None:
            return Draft(tokens, tree, survival=mx.exp(scores))
        return self._priced(tree, tokens, scores, start)

    def _priced(self, tree: Tree, tokens: mx.array, scores: mx.array, start: float) -> Draft:
        """The subtree of the nodes ``TreeBudget`` keeps (the best path probabilities, parents first)."""
        host = np.array(scores.astype(mx.float32))
        order = np.argsort(-host, kind="stable")  # a parent scores at least its child and comes first
        keep = self.budget.choose(host[order], time.perf_counter() - start)
        self._back_off(keep)
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

    def _back_off(self, keep: int) -> None:
        """After ``PLAIN_RUN`` plain-priced rounds in a row, rest the heads for ``_wait`` rounds, doubling the
        wait (up to ``MAX_WAIT``) each time the round after a rest is priced plain too; a kept node resets it."""
        if keep > 0:
            self._plain_run, self._wait = 0, self.FIRST_WAIT
            return
        self._plain_run += 1
        if self._plain_run >= self.PLAIN_RUN:
            self._skip, self._wait = self._wait, min(2 * self._wait, self.MAX_WAIT)
            self._plain_run = self.PLAIN_RUN - 1  # the next probe alone decides the next rest

    def commit(self, num_committed, accepted, hidden=None):
        if self.budget is not None:
            self.budget.update(len(accepted))
        if hidden is not None:
            self._hidden = hidden[accepted[-1] + 1 if accepted else 0]


@dataclass(frozen=True)
class MedusaOptions:
    """``--drafter medusa`` (spec ``medusa:heads=PATH,tree=small_15``).

    Raises:
        ValueError, FileNotFoundError: an unknown tree preset or a bad tree file.
    """

    heads: str | None = option(None, "Medusa heads: a folder, a medusa_lm_head.safetensors/.pt file, or a Hugging "
                                     "Face repo id", default_help="the heads shipped in models/medusa/ for the target")
    tree: str = option(AUTO_TREE, f"Medusa tree: 'auto' (mc_sim_7b_63, keeping each round the nodes this machine's "
                                  f"measured verify cost pays for, none when plain decoding is faster), a preset "
                                  f"({', '.join(TREE_PRESETS)}) verified whole, or a JSON file of rank paths")

    def __post_init__(self):
        if self.tree != AUTO_TREE:
            read_tree(self.tree)


def build(options: MedusaOptions, context: DrafterContext) -> MedusaDrafter:
    """Raises ``ValueError``/``FileNotFoundError``: no heads for the target, or heads that do not fit it."""
    path = context.asset("medusa", options.heads and str(medusa_folder(options.heads)))
    target = context.target
    heads = load_medusa(path, hidden_size=target.args.hidden_size, vocab_size=logits_width(target))
    if options.tree == AUTO_TREE:
        return MedusaDrafter(heads, output_head(target), MC_SIM_7B_63, costs=context.verify_costs)
    return MedusaDrafter(heads, output_head(target), read_tree(options.tree))


DRAFTER = register(DrafterType("medusa", MedusaOptions, build,
                               "Medusa heads on the target's last hidden state, a static tree (Cai et al. 2024)",
                               order=30))
