"""Logits → the sampling distribution p (target) or q (drafter).

One warp for both sides of speculative decoding: the same logits processors
(repetition penalty, any mlx-lm ``LogitsProcessor``) and the same filters as
``mlx_lm.sample_utils.make_sampler`` (top-p, then min-p, then top-k, on the
untempered log-probabilities, then temperature). Drawing from
``warp(logits)`` is therefore exactly what mlx-lm's plain sampler draws from,
so "lossless" means "distributed as ``mlx_lm.generate`` with the same settings".
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_repetition_penalty,
)

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


#: Smallest positive temperature: logits / temp stays well inside float32 for any logits.
MIN_TEMP = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. Validated on construction.

    Attributes:
        temp: Temperature; ``0`` means greedy (argmax). Default: ``0.0``.
        top_p: Nucleus mass in (0, 1]; ``1`` disables it. Default: ``1.0``.
        top_k: Keep the k most likely tokens; ``0`` disables it. Default: ``0``.
        min_p: Drop tokens below ``min_p`` × the top probability, in [0, 1);
            ``0`` disables it. Default: ``0.0``.
        repetition_penalty: mlx-lm's multiplicative penalty over the last
            ``repetition_context_size`` tokens; ``None`` or ``1`` disables it.
        repetition_context_size: Tokens the penalty looks back over. Default: ``20``.
        logits_processors: Extra mlx-lm processors ``(tokens [L], logits [1, V]) -> logits``,
            each seeing the exact prefix of the position it scores.

    Raises:
        TypeError: a value of the wrong kind (text for a number, ``True`` for ``top_k``), naming the field.
        ValueError: on a value outside the ranges above.
    """

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    logits_processors: Sequence[LogitsProcessor] = field(default=(), compare=False)

    def __post_init__(self):
        def real(value) -> bool:  # numpy scalars count; True does not
            return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))

        def integer(value) -> bool:
            return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))

        kinds = [("temp", real(self.temp)), ("top_p", real(self.top_p)), ("top_k", integer(self.top_k)),
                 ("min_p", real(self.min_p)),
                 ("repetition_penalty", self.repetition_penalty is None or real(self.repetition_penalty)),
                 ("repetition_context_size", integer(self.repetition_context_size)),
                 ("logits_processors", isinstance(self.logits_processors, (list, tuple))
                  and all(callable(p) for p in self.logits_processors))]
        for name, ok in kinds:
            if not ok:
                what = ("a list of callables (tokens, logits) -> logits" if name == "logits_processors"
                        else "an integer" if name in ("top_k", "repetition_context_size") else "a number")
                raise TypeError(f"{name} must be {what}, got {getattr(self, name)!r}")
        checks = [
            (
                math.isfinite(self.temp) and self.temp >= 0,
                f"temp must be >= 0 and finite (--temp; 0 = greedy), got {self.temp}",
            ),
            (
                self.temp == 0 or self.temp >= MIN_TEMP,
                f"temp must be 0 (greedy) or at least {MIN_TEMP:g} (--temp; below it 1/temp overflows the "
                f"float32 logits), got {self.temp}",
            ),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (--top-p; 1 = off), got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be an integer >= 0 (--top-k; 0 = off), got {self.top_k}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1) (--min-p; 0 = off), got {self.min_p}"),
            (
                self.repetition_penalty is None
                or (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)),
                f"repetition_penalty must be > 0 and finite (--repetition-penalty; 1 = off), got "
                f"{self.repetition_penalty}",
            ),
            (
                self.repetition_context_size >= 1,
                f"repetition_context_size must be >= 1, got {self.repetition_context_size}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def processors(self) -> list[LogitsProcessor]:
        """The logits processors in the order they apply (penalty first)."""
        out = []
        if self.repetition_penalty not in (None, 1.0):
            out.append(make_repetition_penalty(self.repetition_penalty, self.repetition_context_size))
        return out + list(self.logits_processors)


def process_logits(
    logits: mx.array,
    history: mx.array,
    processors: Sequence[LogitsProcessor],
    draft_tokens: mx.array | None = None,
    paths: Sequence[Sequence[int]] | None = None,
) -> mx.array:
    """Apply logits processors row by row, each row seeing its own prefix.

    Row ``i`` scores the position after ``history`` followed by the draft tokens on
    ``paths[i]``: exactly the prefix plain decoding would have had there.

    Args:
        logits (mx.array): Scores, shape [T, V].
        history (mx.array): Committed tokens (prompt + output), shape [L], int32.
        processors: mlx-lm logits processors ``(tokens [L], logits [1, V]) -> [1, V]``.
        draft_tokens (mx.array | None): Draft tokens, shape [N], int32; may be lazy.
        paths: For each row, the draft-token indices between ``history`` and that row's
            position. Default: a chain, ``paths[i] = range(i)``.

    Returns:
        mx.array: Processed scores, shape [T, V]; ``logits`` itself when there are no processors.
    """
    if not processors:
        return logits
    paths = paths if paths is not None else [range(i) for i in range(logits.shape[0])]
    rows = []
    for i, path in enumerate(paths):
        path = list(path)
        prefix = mx.concatenate([history, draft_tokens[mx.array(path)]]) if path else history
        row = logits[i : i + 1]
        for processor in processors:
            row = processor(prefix, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def warp(logits: mx.array, params: SamplingParams) -> mx.array:
    """Turn (processed) logits into the sampling distribution's log-probabilities.

    The filters are mlx-lm's own (``apply_top_p``, ``apply_min_p``, ``apply_top_k``),
    in ``make_sampler``'s order, followed by the temperature and a renormalisation.

    Args:
        logits (mx.array): Scores, shape [..., V], any float dtype.
        params: Sampling parameters with ``temp > 0``.

    Returns:
        mx.array: log p (or log q), shape [..., V], float32, normalised; filtered
        tokens are ``-inf``.

    Raises:
        ValueError: if ``params.temp == 0`` (greedy has no distribution to warp).
    """
    if params.greedy:
        raise ValueError("warp() needs temp > 0; greedy decoding uses argmax")
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    scaled = logprobs * (1.0 / params.temp)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def sample(logits: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array | None]:
    """Draw one token per row, without a host sync.

    Args:
        logits (mx.array): Processed scores, shape [T, V].
        params: Sampling parameters.

    Returns:
        tuple: tokens [T] int32 and the log-distribution they were drawn from
        [T, V] float32, or ``None`` when greedy (the draw is deterministic, q is one-hot).
    """
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32), None
    logprobs = warp(logits, params)
    return mx.random.categorical(logprobs, axis=-1).astype(mx.int32), logprobs
