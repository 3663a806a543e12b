"""What a target model is, so shipped heads are matched to the model and not to a folder's name.

A Medusa or EAGLE head is only right for the target it was trained on. A folder name says little
(two models may share one; one model has many spellings), so each shipped head folder holds
``target.json``, the target's **card**: its shape (``model_type``, width, layers, vocabulary) and a
fingerprint of its weights, the first ``FINGERPRINT_DIMS`` values of ``FINGERPRINT_ROWS`` rows of
the token embedding. A model matches a card when the shape is equal and the fingerprints'
cosine similarity is at least ``MATCH_COSINE``: the same weights in another dtype or quantization
(the 4-bit GGUF against float32) stay near 1, another model's embeddings are near 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .assets import PUBLISHED, SHIPPED_MARKERS, WHAT, models_dir
from ..core.taps import model_body

#: The card's file in a shipped head folder.
CARD_FILE = "target.json"
#: Embedding rows and values per row in the fingerprint.
FINGERPRINT_ROWS, FINGERPRINT_DIMS = 16, 32
#: Lowest cosine similarity of two fingerprints of the same model (4-bit rounding keeps it above 0.99).
MATCH_COSINE = 0.9
_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")


def model_card(model: nn.Module) -> dict:
    """The card of an mlx-lm model: its shape and a fingerprint of its token embedding.

    Args:
        model (nn.Module): An mlx-lm model (quantized or not).

    Returns:
        dict: ``model_type`` (str or ``None``), ``hidden_size``, ``num_hidden_layers``, ``vocab_size``
        (ints) and ``fingerprint``, ``FINGERPRINT_ROWS * FINGERPRINT_DIMS`` floats.
    """
    body = model_body(model)
    rows = _fingerprint_rows(_vocab_size(body.embed_tokens))
    embeds = body.embed_tokens(mx.array(rows)).astype(mx.float32)  # [ROWS, D], dequantized
    return {
        "model_type": getattr(getattr(model, "args", None), "model_type", None),
        "hidden_size": int(embeds.shape[-1]),
        "num_hidden_layers": len(body.layers),
        "vocab_size": _vocab_size(body.embed_tokens),
        "fingerprint": [round(float(v), 5) for v in np.array(embeds[:, :FINGERPRINT_DIMS]).ravel()],
    }


def _vocab_size(embed: nn.Module) -> int:
    return int(getattr(embed, "num_embeddings", None) or embed.weight.shape[0])


def _fingerprint_rows(vocab: int) -> list[int]:
    """Rows spread over the first 90% of the vocabulary (the tail may be padding)."""
    return [int((i + 0.5) * 0.9 * vocab / FINGERPRINT_ROWS) for i in range(FINGERPRINT_ROWS)]


def same_model(card: dict, other: dict) -> bool:
    """Whether two cards describe the same model (equal shape, fingerprint cosine >= ``MATCH_COSINE``)."""
    if any(card.get(key) != other.get(key) for key in _SHAPE_KEYS):
        return False
    a, b = np.asarray(card.get("fingerprint", ()), float), np.asarray(other.get("fingerprint", ()), float)
    if a.shape != b.shape or not a.size:
        return False
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return bool(norm > 0 and a @ b / norm >= MATCH_COSINE)


def describe_card(card: dict) -> str:
    """A short description of a card's shape, e.g. ``"llama, hidden 576, 30 layers, vocabulary 49152"``."""
    return (f"{card['model_type'] or 'unknown type'}, hidden {card['hidden_size']}, "
            f"{card['num_hidden_layers']} layers, vocabulary {card['vocab_size']}")


def write_card(folder: str | Path, target: nn.Module, name: str | None = None) -> Path:
    """Write ``target.json`` (the target's card, plus its ``name`` if given) into a head folder.

    Returns:
        Path: The file written.
    """
    path = Path(folder) / CARD_FILE
    path.write_text(json.dumps({"name": name, **model_card(target)}) + "\n")
    return path


def shipped_for(kind: str, target: nn.Module) -> Path | None:
    """The shipped ``kind`` folder (``models/<kind>/*/``) whose card matches ``target``, or ``None``.

    Args:
        kind: ``"medusa"`` or ``"eagle"``.
        target: The loaded target.

    Raises:
        ValueError: on an unknown kind.
    """
    if kind not in SHIPPED_MARKERS:
        raise ValueError(f"unknown asset kind {kind!r}; choose one of {', '.join(SHIPPED_MARKERS)}")
    card = model_card(target)
    for folder in sorted(p for p in (models_dir() / kind).glob("*") if (p / SHIPPED_MARKERS[kind]).is_file()):
        try:
            theirs = json.loads((folder / CARD_FILE).read_text())
        except (OSError, ValueError):
            continue  # no card: never matched by name alone
        if same_model(theirs, card):
            return folder
    return None


def require_shipped_for(kind: str, target: nn.Module) -> Path:
    """``shipped_for``, or a one-line error saying no head ships for this model and what to pass.

    Raises:
        ValueError: none of the shipped ``kind`` folders is for ``target``.
    """
    path = shipped_for(kind, target)
    if path is None:
        what, flag, train = WHAT[kind]
        raise ValueError(f"no {what} for this model ({describe_card(model_card(target))}); pass {flag} "
                         f"({PUBLISHED[kind]}), or train one with '{train}'")
    return path
