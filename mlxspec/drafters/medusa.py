"""Medusa heads: a static tree of top-k guesses from K extra decoding heads.

Cai et al. 2024, "Medusa" (arXiv 2401.10774), sections 2.1 (heads) and 2.3 (tree
attention). Head k reads the target's final normalised hidden state at position t
and predicts the token at t + k + 2: h ↦ W_k (h + SiLU(A_k h + b_k)), with its own
LM head W_k (Medusa-1 format) or the target's LM head (the shared-head "v2" format).
Each round the heads' top-k tokens fill a static tree of rank paths (``mc_sim_7b_63``
by default); the drafts are deterministic, so verification is the exact tree rule for
one-hot q (heads.md rule 2.4) and the output is distributed as the target's.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..sampling import SamplingParams
from ..tree import Tree
from .base import Draft, Drafter

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
DEFAULT_TREE = "mc_sim_7b_63"


@dataclass(frozen=True)
class MedusaConfig:
    """Shape of a set of Medusa heads (stored as ``config.json`` beside the weights).

    Attributes:
        medusa_num_heads: K, heads (head k predicts position t + k + 2).
        medusa_num_layers: Residual blocks per head (1 in every published checkpoint).
        hidden_size: H, the target's hidden size.
        vocab_size: V, the target's vocabulary (logits width).
        shared_lm_head: Heads end in the target's LM head ("v2") instead of their own.
    """

    medusa_num_heads: int
    hidden_size: int
    vocab_size: int
    medusa_num_layers: int = 1
    shared_lm_head: bool = False


class ResBlock(nn.Module):
    """x + SiLU(W x + b), the Medusa block. W and b start at zero (Medusa zeroes W only),
    so an untrained head is exactly its LM head: SiLU(0) = 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.linear.weight = mx.zeros_like(self.linear.weight)
        self.linear.bias = mx.zeros_like(self.linear.bias)

    def __call__(self, x):
        return x + nn.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads. Parameter names are the published layout once ``heads.`` is dropped:
    ``{k}.{l}.linear.weight|bias`` and ``{k}.{L}.weight`` (own LM head).

    Args:
        config: The heads' shape.
    """

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        H, V, L = config.hidden_size, config.vocab_size, config.medusa_num_layers
        own_head = [] if config.shared_lm_head else [nn.Linear(H, V, bias=False)]
        self.heads = [[ResBlock(H) for _ in range(L)] + own_head for _ in range(config.medusa_num_heads)]

    def __call__(self, hidden: mx.array, lm_head=None) -> mx.array:
        """Logits of every head.

        Args:
            hidden (mx.array): Final normalised target hidden states, shape [..., H].
            lm_head: The target's LM head (``taps.output_head``); used when the heads share it.

        Returns:
            mx.array: Logits, shape [K, ..., V]; head k scores position t + k + 2.
        """
        out = []
        for head in self.heads:
            h = hidden
            for block in head[: self.config.medusa_num_layers]:
                h = block(h)
            out.append(lm_head(h) if self.config.shared_lm_head else head[-1](h))
        return mx.stack(out)


# --- checkpoints ---------------------------------------------------------------------------

_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


def _from_vllm(weights: dict) -> dict:
    """vLLM-converted names (``blocks.{k}.layers.{l}``, ``lm_heads.{k}``) → the Medusa layout."""
    num_layers = 1 + max((int(m[2]) for k in weights if (m := _VLLM_BLOCK.match(k))), default=0)
    out = {}
    for key, value in weights.items():
        if m := _VLLM_BLOCK.match(key):
            out[f"{m[1]}.{m[2]}.linear.{m[3]}"] = value
        elif m := _VLLM_HEAD.match(key):
            out[f"{m[1]}.{num_layers}.weight"] = value
        else:
            out[key] = value
    return out


def config_from_weights(weights: dict, *, hidden_size: int, vocab_size: int) -> MedusaConfig:
    """Infer the head count, depth and format from tensor names (published configs under-count).

    Raises:
        ValueError: if no Medusa tensors are present.
    """
    blocks = {tuple(map(int, m.groups())) for k in weights if (m := re.match(r"^(\d+)\.(\d+)\.linear\.weight$", k))}
    if not blocks:
        raise ValueError("no Medusa head tensors ('{k}.{l}.linear.weight') found in the checkpoint")
    num_heads = 1 + max(k for k, _ in blocks)
    num_layers = 1 + max(layer for _, layer in blocks)
    shared = f"0.{num_layers}.weight" not in weights
    return MedusaConfig(num_heads, hidden_size, vocab_size, num_layers, shared)


def load_medusa(path: str | Path, *, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Load Medusa heads from a folder or file: ``medusa_lm_head.safetensors`` (original or
    shared-head "v2" layout) or a vLLM-converted ``model.safetensors``; torch pickles
    (``medusa_lm_head.pt``, ``*.bin``) through the weights-only reader.

    Args:
        path: A folder holding one of those files, or the file itself.
        hidden_size, vocab_size: The target's H and V, which the heads must match.

    Returns:
        MedusaHeads: Evaluated, in eval mode.

    Raises:
        FileNotFoundError: no weights file found.
        ValueError: the heads' hidden size or vocabulary does not fit the target.
    """
    path = Path(path).expanduser()
    # keep the head tensors only: training checkpoints may carry other entries
    weights = {k: v for k, v in _from_vllm(_read_weights(path)).items() if re.match(r"^\d+\.\d+\.", k)}
    config = config_from_weights(weights, hidden_size=hidden_size, vocab_size=vocab_size)
    found_h = weights["0.0.linear.weight"].shape[1]
    if found_h != hidden_size:
        raise ValueError(f"Medusa heads in {path} have hidden size {found_h} but the target has {hidden_size}; "
                         "use heads trained for this target")
    if not config.shared_lm_head:
        found_v = weights[f"0.{config.medusa_num_layers}.weight"].shape[0]
        if found_v != vocab_size:
            raise ValueError(f"Medusa heads in {path} have vocabulary {found_v} but the target has {vocab_size}; "
                             "use heads trained for this target")
    heads = MedusaHeads(config)
    heads.load_weights([(f"heads.{k}", v.astype(mx.float32)) for k, v in weights.items()], strict=True)
    mx.eval(heads.parameters())
    heads.eval()
    return heads


def save_medusa(path: str | Path, heads: MedusaHeads) -> None:
    """Write ``medusa_lm_head.safetensors`` (published layout) and ``config.json`` into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {k.removeprefix("heads."): v for k, v in tree_flatten(heads.parameters())}
    mx.save_safetensors(str(path / "medusa_lm_head.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(asdict(heads.config), indent=2) + "\n")


def medusa_folder(spec: str) -> Path:
    """A local folder or file, or a Hugging Face repo id fetched with ``huggingface_hub``
    (safetensors, JSON and, for the weights-only reader, ``.pt``/``.bin`` files).

    Raises:
        FileNotFoundError: a path that does not exist and does not look like a repo id.
        ValueError: a repo that cannot be fetched.
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path
    from ..loading import hub_folder, looks_like_repo_id

    if looks_like_repo_id(spec):
        return hub_folder(spec, allow_patterns=["*.json", "*.safetensors", "medusa_lm_head.pt", "*.bin"])
    raise FileNotFoundError(f"no such Medusa heads folder or file: {spec}; pass a path or a Hugging Face repo id")


def default_heads(model_name: str) -> Path | None:
    """Heads shipped in the repository's ``models/medusa/<model_name>/`` (``$MLXSPEC_MODELS``
    overrides the ``models`` folder), or ``None``."""
    folder = models_dir() / "medusa" / model_name
    return folder if (folder / "medusa_lm_head.safetensors").is_file() else None


def models_dir() -> Path:
    """The ``models/`` assets folder: ``$MLXSPEC_MODELS``, else the one beside the package."""
    import os

    return Path(os.environ.get("MLXSPEC_MODELS") or Path(__file__).resolve().parents[2] / "models")


def _read_weights(path: Path) -> dict:
    if path.is_dir():
        for name in ("medusa_lm_head.safetensors", "model.safetensors", "medusa_lm_head.pt", "pytorch_model.bin"):
            if (path / name).is_file():
                return _read_weights(path / name)
        raise FileNotFoundError(f"no Medusa weights in {path}: expected medusa_lm_head.safetensors "
                                "(or model.safetensors / medusa_lm_head.pt)")
    if not path.is_file():
        raise FileNotFoundError(f"no such Medusa checkpoint: {path}")
    if path.suffix == ".safetensors":
        return mx.load(str(path))
    from ..pickle_reader import load_torch_weights

    return load_torch_weights(path)


# --- the drafter ---------------------------------------------------------------------------


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


class MedusaDrafter(Drafter):
    """Proposes the static Medusa tree from the heads' top-k at the last verified position.

    Args:
        heads: Loaded ``MedusaHeads``.
        lm_head: The target's LM head (``taps.output_head(target)``).
        choices: Rank paths of the tree. Default: ``mc_sim_7b_63``.
    """

    name = "medusa"
    lazy = True
    makes_trees = True
    needs_hidden = True

    def __init__(self, heads: MedusaHeads, lm_head, choices: list[list[int]] | None = None):
        self.heads, self.lm_head = heads, lm_head
        self.choices = choices if choices is not None else MC_SIM_7B_63
        self._trees: dict[int, tuple[Tree, mx.array, mx.array, int]] = {}
        self._hidden = None  # [H]: hidden state at the position before the root

    def _tree(self, depth: int):
        if depth not in self._trees:
            tree, heads, ranks = tree_from_choices(self.choices, depth)
            top_k = int(ranks.max()) + 1 if tree.size else 0
            self._trees[depth] = (tree, mx.array(heads), mx.array(ranks), top_k)
        return self._trees[depth]

    def prefill(self, prompt, hidden=None):
        self._hidden = None if hidden is None or hidden.shape[0] == 0 else hidden[-1]

    def propose(self, history, num_draft_tokens, sampling: SamplingParams):
        depth = min(num_draft_tokens, self.heads.config.medusa_num_heads)
        if self._hidden is None or depth < 1:
            return Draft.empty()
        tree, node_heads, node_ranks, top_k = self._tree(depth)
        logits = self.heads(self._hidden[None], self.lm_head)[:depth, 0]  # [depth, V]
        best = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k]  # [depth, top_k], unordered
        order = mx.argsort(-mx.take_along_axis(logits, best, axis=-1), axis=-1)
        ranked = mx.take_along_axis(best, order, axis=-1)  # [depth, top_k]: rank 0 = most likely
        tokens = ranked[node_heads, node_ranks].astype(mx.int32)
        mx.async_eval(tokens)
        return Draft(tokens, tree)

    def commit(self, num_committed, accepted, hidden=None):
        if hidden is not None:
            self._hidden = hidden[accepted[-1] + 1 if accepted else 0]
