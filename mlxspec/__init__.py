"""mlxspec: lossless speculative decoding for LLMs with MLX.

    from mlxspec import load, generate, SamplingParams
    model, tokenizer = load("default")
    result = generate(model, tokenizer, "Hello", drafter="ngram", sampling=SamplingParams(temp=0.7))
"""

from __future__ import annotations

from .cache import PromptCache
from .drafters import Draft, Drafter, make_drafter
from .generate import GenerationResult, generate, stream_generate
from .loading import load
from .metrics import CycleStats, GenerationStats, TokenEvent
from .sampling import SamplingParams

__all__ = [
    "CycleStats",
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

