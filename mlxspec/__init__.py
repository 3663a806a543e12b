"""mlxspec: lossless speculative decoding for LLMs with MLX.

    from mlxspec import load, generate, SamplingParams
    model, tokenizer = load("default")
    result = generate(model, tokenizer, "Hello", drafter="ngram", sampling=SamplingParams(temp=0.7))
"""

from __future__ import annotations

from .core.cache import PromptCache
from .drafters import Draft, Drafter, make_drafter
from .engine.generate import GenerationResult, generate, stream_generate
from .loading.models import load
from .core.metrics import RoundStats, GenerationStats, TokenEvent
from .core.sampling import SamplingParams

__all__ = [
    "RoundStats",
    "Draft",
    "Drafter",
    "GenerationResult",
    "GenerationStats",
    "PromptCache",
    "SamplingParams",
    "TokenEvent",
    "generate",
    "load",
    "make_drafter",
    "stream_generate",
]

