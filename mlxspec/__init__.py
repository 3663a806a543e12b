"""mlxspec: lossless speculative decoding for LLMs with MLX.

    from mlxspec import load, generate, SamplingParams
    model, tokenizer = load("default")
    result = generate(model, tokenizer, "Hello", drafter="ngram", sampling=SamplingParams(temp=0.7))

The public names are imported on first use (PEP 562), so the ``mlxspec`` command starts without
importing MLX and mlx-lm: a Ctrl+C in its first second is then one line, not an import traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: Public name → the module that defines it.
_PUBLIC = {
    "PromptCache": "core.cache",
    "Draft": "drafters",
    "Drafter": "drafters",
    "make_drafter": "drafters",
    "GenerationResult": "engine.generate",
    "generate": "engine.generate",
    "stream_generate": "engine.generate",
    "batch_generate": "engine.runner",
    "load": "loading.models",
    "RoundStats": "core.metrics",
    "GenerationStats": "core.metrics",
    "TokenEvent": "core.metrics",
    "SamplingParams": "core.sampling",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:
    from .core.cache import PromptCache
    from .core.metrics import GenerationStats, RoundStats, TokenEvent
    from .core.sampling import SamplingParams
    from .drafters import Draft, Drafter, make_drafter
    from .engine.generate import GenerationResult, generate, stream_generate
    from .engine.runner import batch_generate
    from .loading.models import load


def __getattr__(name: str):
    """Import a public name's module the first time the name is read (``from mlxspec import load``)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mlxspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
