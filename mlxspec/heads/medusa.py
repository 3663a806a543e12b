"""Medusa heads: K extra decoding heads over the target's last hidden state, and their checkpoints.

Cai et al. 2024, "Medusa" (arXiv 2401.10774), section 2.1. Head k reads the target's final
normalised hidden state at position t and predicts the token at t + k + 2:
h ↦ W_k (h + SiLU(A_k h + b_k)), with its own LM head W_k (Medusa-1 format) or the target's
LM head (the shared-head "v2" format). Drafting with them is ``mlxspec.drafters.medusa``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..loading.pickle_reader import load_torch_weights
from ..loading.weights import one_line
from .checkpoints import load_safetensors, local_or_hub, write_checkpoint

#: How every error about a file that holds no usable Medusa heads ends: what to pass instead.
PASS_HEADS = (
    "pass Medusa heads instead: a folder with medusa_lm_head.safetensors (as 'mlxspec train medusa' "
    "writes), that file, or a Hugging Face repo id"
)


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
        own_head = lambda: [] if config.shared_lm_head else [nn.Linear(H, V, bias=False)]  # noqa: E731 (one per head)
        self.heads = [[ResBlock(H) for _ in range(L)] + own_head() for _ in range(config.medusa_num_heads)]

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
    blocks = {
        tuple(map(int, m.groups())) for k in weights if (m := re.match(r"^(\d+)\.(\d+)\.linear\.weight$", k))
    }
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
        ValueError: a damaged file, one without Medusa heads, or heads whose hidden size or vocabulary
            does not fit the target.
    """
    path = Path(path).expanduser()
    try:
        raw = _read_weights(path)
    except ValueError as e:  # damaged, or no checkpoint at all
        raise ValueError(f"{one_line(e)}; {PASS_HEADS}") from None
    # keep the head tensors only: training checkpoints may carry other entries
    weights = {k: v for k, v in _from_vllm(raw).items() if re.match(r"^\d+\.\d+\.", k)}
    if not weights:
        raise ValueError(
            f"{path} holds no Medusa head tensors (names such as '0.0.linear.weight'); {PASS_HEADS}"
        )
    config = config_from_weights(weights, hidden_size=hidden_size, vocab_size=vocab_size)
    found_h = weights["0.0.linear.weight"].shape[1]
    if found_h != hidden_size:
        raise ValueError(
            f"Medusa heads in {path} have hidden size {found_h} but the target has {hidden_size}; "
            "use heads trained for this target"
        )
    if not config.shared_lm_head:
        found_v = weights[f"0.{config.medusa_num_layers}.weight"].shape[0]
        if found_v != vocab_size:
            raise ValueError(
                f"Medusa heads in {path} have vocabulary {found_v} but the target has {vocab_size}; "
                "use heads trained for this target"
            )
    heads = MedusaHeads(config)
    heads.load_weights([(f"heads.{k}", v.astype(mx.float32)) for k, v in weights.items()], strict=True)
    mx.eval(heads.parameters())
    heads.eval()
    return heads


def save_medusa(path: str | Path, heads: MedusaHeads) -> None:
    """Write ``medusa_lm_head.safetensors`` (published layout) and ``config.json`` into ``path``."""
    weights = {k.removeprefix("heads."): v for k, v in tree_flatten(heads.parameters())}
    write_checkpoint(path, weights, asdict(heads.config), "medusa_lm_head.safetensors")


def medusa_folder(spec: str) -> Path:
    """A local folder or file, or a Hugging Face repo id fetched with ``huggingface_hub``
    (safetensors, JSON and, for the weights-only reader, ``.pt``/``.bin`` files).

    Raises:
        FileNotFoundError: a path that does not exist and does not look like a repo id.
        ValueError: a repo that cannot be fetched.
    """
    return local_or_hub(spec, ["*.json", "*.safetensors", "medusa_lm_head.pt", "*.bin"],
                        "no such Medusa heads folder or file")


def _read_weights(path: Path) -> dict:
    if path.is_dir():
        for name in (
            "medusa_lm_head.safetensors",
            "model.safetensors",
            "medusa_lm_head.pt",
            "pytorch_model.bin",
        ):
            if (path / name).is_file():
                return _read_weights(path / name)
        raise FileNotFoundError(f"no Medusa weights in {path}: expected medusa_lm_head.safetensors "
                                "(or model.safetensors / medusa_lm_head.pt)")
    if not path.is_file():
        raise FileNotFoundError(f"no such Medusa checkpoint: {path}")
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    return load_torch_weights(path)
