"""Where mlxspec finds the files that ship beside the code: heads and draft models per target.

Shipped assets live in the ``models/`` folder as ``models/<kind>/<model name>/`` (``kind`` is
``medusa``, ``eagle`` or ``draft``; the model name is ``loading.model_name(spec)``, e.g.
``SmolLM2-135M-Instruct``). ``$MLXSPEC_MODELS`` points at another ``models`` folder.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The file whose presence marks a complete shipped asset of each kind.
SHIPPED_MARKERS = {
    "medusa": "medusa_lm_head.safetensors",
    "eagle": "model.safetensors",
    "draft": "config.json",
}
#: What to say when nothing ships: the flag that names one, and how to make one.
_WHAT = {
    "medusa": ("Medusa heads ship", "--medusa-heads PATH_OR_REPO", "mlxspec train medusa"),
    "eagle": ("EAGLE head ships", "--eagle-heads PATH_OR_REPO", "mlxspec train eagle"),
    "draft": ("draft model ships", "--draft-model PATH_OR_REPO", "mlxspec train draft"),
}


def models_dir() -> Path:
    """The ``models/`` assets folder: ``$MLXSPEC_MODELS``, else the one beside the package."""
    return Path(os.environ.get("MLXSPEC_MODELS") or Path(__file__).resolve().parents[1] / "models")


def shipped(kind: str, model_name: str) -> Path | None:
    """The folder ``models/<kind>/<model_name>/`` if a complete asset of that kind ships there.

    Args:
        kind: ``"medusa"``, ``"eagle"`` or ``"draft"``.
        model_name: The target's name (``loading.model_name``), e.g. ``"SmolLM2-135M-Instruct"``.

    Returns:
        Path | None: The folder, or ``None`` when none ships.

    Raises:
        ValueError: on an unknown kind.
    """
    if kind not in SHIPPED_MARKERS:
        raise ValueError(f"unknown asset kind {kind!r}; choose one of {', '.join(SHIPPED_MARKERS)}")
    folder = models_dir() / kind / model_name
    return folder if (folder / SHIPPED_MARKERS[kind]).is_file() else None


def require_shipped(kind: str, model_name: str) -> Path:
    """``shipped``, or a one-line error naming the flag to pass and the command that trains one.

    Raises:
        ValueError: none ships for ``model_name``.
    """
    path = shipped(kind, model_name)
    if path is None:
        what, flag, train = _WHAT[kind]
        raise ValueError(f"no {what} for {model_name}; pass {flag} (or make one with '{train}')")
    return path
