"""Draft trees: structure, tree mask, positions, sibling tables and the accepted-path walk.

Node numbering used by verification: index 0 is the root (the last committed token,
not yet in the KV cache), draft node ``i`` is index ``i + 1``. ``parents`` lists each
draft node's parent in draft numbering (``-1`` = the root) and must be topological
(``parents[i] < i``). A chain is the tree with ``parents = (-1, 0, 1, ...)``.

Static trees are also written as rank paths (Medusa, EAGLE-1): ``[0, 1]`` is the second most
likely child of the most likely child of the root. The shipped presets and ``read_tree`` /
``read_eagle_tree`` (preset names or JSON files of rank paths) live here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Tree:
    """Structure of a draft tree over its root (SpecInfer arXiv 2305.09781, section 4).

    Attributes:
        parents: Parent of each draft node, ``-1`` for the root; shape [N], topological.

    Raises:
        ValueError: if a parent does not precede its child.
    """

    parents: tuple[int, ...]

    def __post_init__(self):
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"draft node {i} has parent {parent}; parents must precede children")

    @property
    def size(self) -> int:
        """N, draft nodes (root excluded)."""
        return len(self.parents)

    @cached_property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    @cached_property
    def node_parents(self) -> np.ndarray:
        """Parent of every node in root-first numbering; [N + 1] int, ``-1`` for the root."""
        return np.array([-1] + [p + 1 for p in self.parents], dtype=np.int64)

    @cached_property
    def depths(self) -> np.ndarray:
        """Depth of every node, root first (root 0); [N + 1] int32."""
        depths = np.zeros(self.size + 1, dtype=np.int32)
        for node in range(1, self.size + 1):
            depths[node] = depths[self.node_parents[node]] + 1
        return depths

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """Tree mask: ``[i, j]`` True when node j is node i or one of its ancestors; [N + 1, N + 1] bool."""
        mask = np.eye(self.size + 1, dtype=bool)
        for node in range(1, self.size + 1):
            mask[node] |= mask[self.node_parents[node]]
        return mask

    @cached_property
    def children(self) -> np.ndarray:
        """Sibling table: row n lists node n's children in draft order, ``-1`` padded; [N + 1, C] int32.

        ``C`` is the largest number of children of any node (at least 1).
        """
        kids = [[] for _ in range(self.size + 1)]
        for node in range(1, self.size + 1):
            kids[self.node_parents[node]].append(node)
        table = np.full((self.size + 1, max(1, max(map(len, kids)))), -1, dtype=np.int32)
        for node, row in enumerate(kids):
            table[node, : len(row)] = row
        return table

    def path_to(self, node: int) -> list[int]:
        """Draft-node indices (0-based) from the root's first child down to ``node`` (root-first
        numbering)."""
        path = []
        while node > 0:
            path.append(node - 1)
            node = int(self.node_parents[node])
        return path[::-1]

    def walk(self, choice: list[int]) -> list[int]:
        """Follow the accepted child of each node from the root.

        Args:
            choice: ``[n]`` = root-first index of node n's accepted child, or ``0`` for none; [N + 1].

        Returns:
            list[int]: Root-first indices of the accepted nodes, in order (the root excluded).
        """
        path, node = [], 0
        while choice[node] > 0:
            node = choice[node]
            path.append(node)
        return path

    def is_leaf(self, node: int) -> bool:
        return bool(self.children[node, 0] < 0)


@lru_cache(maxsize=64)
def chain(num_nodes: int) -> Tree:
    """The chain of ``num_nodes`` draft tokens (one shared, immutable ``Tree`` per length, so a
    round does not rebuild its sibling table and depths)."""
    return Tree(tuple(range(-1, num_nodes - 1)))


def sibling_tokens(tokens: mx.array, children: np.ndarray) -> tuple[mx.array, mx.array]:
    """Tokens of each node's children, and which slots hold a real, first-seen child.

    Args:
        tokens (mx.array): Root-first node tokens, shape [N + 1], int32.
        children (np.ndarray): Sibling table from ``Tree.children``, shape [N + 1, C].

    Returns:
        tuple[mx.array, mx.array]: sibling tokens [N + 1, C] int32 (0 in padding) and a
        [N + 1, C] bool mask that is False for padding and for a token already offered by an
        earlier sibling (docs/acceptance.md 2.4 skips those).
    """
    slots = mx.array(np.maximum(children, 0))
    tok = tokens[slots]  # [N + 1, C]
    valid = mx.array(children >= 0)
    C = children.shape[1]
    earlier = mx.array(np.tril(np.ones((C, C), dtype=bool), k=-1))  # [j, i]: i before j
    repeated = ((tok[:, :, None] == tok[:, None, :]) & valid[:, None, :] & earlier[None]).any(axis=2)
    return tok, valid & ~repeated


# --- static trees of rank paths ------------------------------------------------------------

# Medusa's default tree for Vicuna-7B (63 nodes, ranks < 10, depth <= 4): rank paths
# (top-k rank of head 0, head 1, ...) from FasterDecoding/Medusa medusa_choices.py.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
    [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2],
    [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4],
    [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7],
    [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1],
    [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
    [1, 6], [0, 7, 0],
]  # fmt: skip
# A 15-node tree for targets whose verification cost grows fast with width (quantized
# targets on Apple GPUs, the CPU backend): the first 15 entries of the default, which
# Medusa orders by estimated acceptance.
SMALL_15 = MC_SIM_7B_63[:15]
# A chain of depth 4: the top-1 guess of each head.
CHAIN_4 = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
TREE_PRESETS = {"mc_sim_7b_63": MC_SIM_7B_63, "small_15": SMALL_15, "chain_4": CHAIN_4}


def tree_from_choices(choices: list[list[int]], max_depth: int) -> tuple[Tree, np.ndarray, np.ndarray]:
    """Build the static tree of rank paths.

    Args:
        choices: Rank paths, e.g. ``[[0], [0, 0], [1], ...]``: a node at depth d takes the
            ``path[-1]``-th most likely token of head d - 1. Every prefix of a path must be listed.
        max_depth: Keep nodes no deeper than this (the number of heads, or γ).

    Returns:
        tuple: the ``Tree`` (nodes sorted by depth, then path), and per node the head [N] and
        rank [N] that pick its token.

    Raises:
        ValueError: if a path's prefix is missing or a rank is negative.
    """
    paths = sorted({tuple(c) for c in choices if 0 < len(c) <= max_depth}, key=lambda c: (len(c), c))
    index = {path: i for i, path in enumerate(paths)}
    parents = []
    for path in paths:
        if min(path) < 0:
            raise ValueError(f"Medusa tree path {list(path)} has a negative rank")
        if len(path) > 1 and path[:-1] not in index:
            raise ValueError(f"Medusa tree path {list(path)} has no parent {list(path[:-1])} in the tree")
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
    heads = np.array([len(p) - 1 for p in paths], dtype=np.int32)
    ranks = np.array([p[-1] for p in paths], dtype=np.int32)
    return Tree(tuple(parents)), heads, ranks


def read_tree(spec: str) -> list[list[int]]:
    """A preset name (see ``TREE_PRESETS``) or a JSON file holding a list of rank paths.

    Raises:
        ValueError: unknown preset or malformed file.
    """
    if spec in TREE_PRESETS:
        return TREE_PRESETS[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"unknown Medusa tree {spec!r}: name a preset ({', '.join(TREE_PRESETS)}) "
                         "or a JSON file with a list of rank paths")
    try:
        choices = json.loads(path.read_text())
        assert isinstance(choices, list) and all(isinstance(c, list) and c for c in choices)
    except (json.JSONDecodeError, AssertionError) as e:
        raise ValueError(f"{path} is not a JSON list of rank paths like [[0], [0, 0], [1]]") from e
    return choices


#: EAGLE-1's static tree (SafeAILab/EAGLE v1 ``choices.py``, confusingly also named ``mc_sim_7b_63``;
#: docs/heads.md 4.4): 25 nodes, depth 5; a rank indexes the draft's top-k at the PARENT node.
EAGLE1_TREE = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0], [0, 0, 1],
    [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1],
    [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]  # fmt: skip
#: ``--eagle-tree`` values besides a JSON file of rank paths.
EAGLE_TREES = {"dynamic": None, "eagle1_25": EAGLE1_TREE}


def read_eagle_tree(spec: str | list | None) -> list[list[int]] | None:
    """``None``/``"dynamic"`` (EAGLE-2's dynamic tree), a preset name, a list of rank paths, or a JSON file of
    them.

    Raises:
        ValueError: an unknown name or a malformed file.
    """
    if spec is None or isinstance(spec, list):
        return spec
    if spec in EAGLE_TREES:
        return EAGLE_TREES[spec]
    if not Path(spec).expanduser().is_file():
        raise ValueError(f"unknown EAGLE tree {spec!r}: name one of {', '.join(EAGLE_TREES)} "
                         "or a JSON file with a list of rank paths such as [[0], [1], [0, 0]]")
    return read_tree(spec)
