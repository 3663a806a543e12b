"""Checks of what a caller hands ``stream_generate``: arguments of the right kind, token ids in the
vocabulary.

A bytes prompt would otherwise read as token ids, ``num_draft_tokens=3.5`` as γ 3.5, and an id past the
embedding's end crashes the process (an out-of-bounds gather), so each is refused in one line naming it.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafters import Drafter, DrafterSpec
from ..core.sampling import SamplingParams
from ..pacing import Pacer


def is_int(value) -> bool:
    """An integer, not a bool (``True`` is an ``int`` to Python, never a count or an id to us)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_prompt(prompt, name: str = "prompt") -> None:
    """Refuse a prompt that is neither text nor token ids (a bytes prompt would otherwise read as ids);
    ``name`` is what the message calls it.

    Raises:
        TypeError: naming what a prompt takes.
    """
    ids = isinstance(prompt, (list, tuple)) and all(is_int(i) for i in prompt)
    array = (
        isinstance(prompt, np.ndarray) and prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer)
    ) or (isinstance(prompt, mx.array) and prompt.ndim == 1 and mx.issubdtype(prompt.dtype, mx.integer))
    if not (isinstance(prompt, str) or ids or array):
        raise TypeError(
            f"{name} must be text (str) or a list of token ids (int), got {type(prompt).__name__}"
        )


def check_types(drafter, num_draft_tokens, max_tokens, sampling, stop_tokens=None, prefill_step_size: int = 1,
                seed=None) -> None:
    """Refuse arguments of the wrong kind or out of range, with a message naming the argument and what it
    takes (``num_draft_tokens=3.5`` would otherwise read as γ 3.5).

    Raises:
        TypeError: naming the argument.
        ValueError: ``max_tokens < 1``, ``prefill_step_size < 1``, a seed outside [0, 2**64).
    """
    if not isinstance(drafter, (str, DrafterSpec, Drafter)):
        raise TypeError(
            f"drafter must be a Drafter, a DrafterSpec or a spec string such as 'ngram' or 'none', got "
            f"{type(drafter).__name__}"
        )
    if not (is_int(num_draft_tokens) or isinstance(num_draft_tokens, (str, Pacer))):
        raise TypeError(
            f"num_draft_tokens must be an integer, 'auto', 'scheduled' or a pacer (pacing.make_pacer), got "
            f"{num_draft_tokens!r}"
        )
    if not is_int(max_tokens):
        raise TypeError(f"max_tokens must be an integer, got {max_tokens!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if seed is not None and not (is_int(seed) and 0 <= seed < 2**64):
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(
            "sampling must be a SamplingParams (e.g. SamplingParams(temp=0.7)), got "
            f"{type(sampling).__name__}"
        )
    if stop_tokens is not None and not (isinstance(stop_tokens, (set, frozenset, list, tuple))
                                        and all(is_int(t) for t in stop_tokens)):
        raise TypeError(f"stop_tokens must be a set of token ids (int), got {stop_tokens!r}")
    if not is_int(prefill_step_size):
        raise TypeError(f"prefill_step_size must be an integer, got {prefill_step_size!r}")
    if prefill_step_size < 1:  # a step of 0 or less would prefill nothing and answer from an empty cache
        raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")


def check_ids(model: nn.Module, ids: list[int]) -> None:
    """Refuse token ids outside the model's vocabulary (an embedding lookup past its end is undefined).

    Raises:
        ValueError: naming the first bad id and the vocabulary size.
    """
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if not vocab:  # no config: the embedding's rows (a quantized embedding packs columns, not rows)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        vocab = getattr(embed, "num_embeddings", None) or (
            embed.weight.shape[0] if embed is not None else None
        )
    if not vocab:
        return  # a model that says nothing of its vocabulary (a test double): nothing to check against
    bad = next((i for i in ids if not 0 <= i < vocab), None)  # ids: Python ints (encode_prompt)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary (ids 0 to {vocab - 1})")


def check_typical(typical) -> tuple[float, float] | None:
    """Medusa's typical acceptance ``(threshold, alpha)``, checked once for the API, ``generate`` and
    ``verify``.

    Raises:
        TypeError: not a pair of numbers.
        ValueError: unless ``0 < threshold <= 1`` and ``0 < alpha`` is finite.
    """
    if typical is None:
        return None
    if not (isinstance(typical, (tuple, list)) and len(typical) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in typical)):
        raise TypeError(f"typical must be a pair (threshold, alpha) of numbers, got {typical!r}")
    threshold, alpha = typical
    if not (0 < threshold <= 1 and 0 < alpha and math.isfinite(alpha)):
        raise ValueError(
            f"typical acceptance needs 0 < --typical-threshold <= 1 and --typical-alpha > 0 (finite), "
            f"got threshold {threshold}, alpha {alpha}"
        )
    return float(threshold), float(alpha)
