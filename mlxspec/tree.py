"""Draft trees: structure, tree mask, positions, sibling tables and the accepted-path walk.

Node numbering used by verification: index 0 is the root (the last committed token,
not yet in the KV cache), draft node ``i`` is index ``i + 1``. ``parents`` lists each
draft node's parent in draft numbering (``-1`` = the root) and must be topological
(``parents[i] < i``). A chain is the tree with ``parents = (-1, 0, 1, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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
        """Draft-node indices (0-based) from the root's first child down to ``node`` (root-first numbering)."""
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


def chain(num_nodes: int) -> Tree:
    """The chain of ``num_nodes`` draft tokens."""
    return Tree(tuple(range(-1, num_nodes - 1)))


def sibling_tokens(tokens: mx.array, children: np.ndarray) -> tuple[mx.array, mx.array]:
    """Tokens of each node's children, and which slots hold a real, first-seen child.

    Args:
        tokens (mx.array): Root-first node tokens, shape [N + 1], int32.
        children (np.ndarray): Sibling table from ``Tree.children``, shape [N + 1, C].

    Returns:
        tuple[mx.array, mx.array]: sibling tokens [N + 1, C] int32 (0 in padding) and a
        [N + 1, C] bool mask that is False for padding and for a token already offered by an
        earlier sibling (rule 2.4 skips those).
    """
    slots = mx.array(np.maximum(children, 0))
    tok = tokens[slots]  # [N + 1, C]
    valid = mx.array(children >= 0)
    C = children.shape[1]
    earlier = mx.array(np.tril(np.ones((C, C), dtype=bool), k=-1))  # [j, i]: i before j
    repeated = ((tok[:, :, None] == tok[:, None, :]) & valid[:, None, :] & earlier[None]).any(axis=2)
    return tok, valid & ~repeated
