"""The round loop's plain steps: pipelined as in ``mlx_lm.generate_step``, and the stretch of them that
γ auto's judgement reads (``Drafter.judge``, docs/acceptance.md 3.4)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .cache import trim
from .drafters import Drafter
from .sampling import SamplingParams, process_logits, sample


class PlainSteps:
    """Plain decoding steps, pipelined as in ``mlx_lm.generate_step``.

    ``take`` returns the next token (lazy), with a ``tap`` the features of the step's input (lazy,
    [1, F]), and when sampling log p of the token drawn ([1] float32, lazy; ``None`` when greedy): the
    step queued by ``queue``, or a new forward over the root. ``queue`` builds the
    following step from a lazy token and ``mx.async_eval``s it, so its forward runs while the host
    reads the current token. A queued step has written its input (the newest committed token) into
    the cache; ``cancel`` trims it when no step follows. The features are taken from the tap as each
    forward is built, since a queued forward records over the previous one's.
    """

    def __init__(self, model, cache, sampling: SamplingParams, tap: HiddenTap | None = None):
        self.model, self.cache, self.sampling, self.tap = model, cache, sampling, tap
        self.processors = sampling.processors()
        self.queued: tuple[mx.array, mx.array | None] | None = None

    def _step(self, inputs: mx.array, context) -> tuple[mx.array, mx.array | None, mx.array | None]:
        logits = self.model(inputs[None], cache=self.cache)[0, -1:]  # [1, V]
        hidden = self.tap.features()[0] if self.tap is not None else None  # [1, F]
        if self.processors:
            logits = process_logits(logits, context(), self.processors)
        token, logprobs = sample(logits, self.sampling)  # [1] int32, lazy
        logp = None if logprobs is None else mx.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
        return token, hidden, logp

    def take(self, history: list[int]) -> tuple[mx.array, mx.array | None, mx.array | None]:
        step, self.queued = self.queued, None
        if step is None:
            step = self._step(mx.array(history[-1:], dtype=mx.int32), lambda: mx.array(history, dtype=mx.int32))
        return step

    def queue(self, token: mx.array, history: list[int]) -> None:
        self.queued = self._step(token, lambda: mx.concatenate([mx.array(history, dtype=mx.int32), token]))
        mx.async_eval(*(a for a in self.queued if a is not None))

    def cancel(self) -> None:
        if self.queued is not None:
            self.queued = None
            trim(self.cache, 1)


class Stretch:
    """The tokens decoded plainly since the last drafting round (from index ``start`` of the history) and the
    target's log p of each (0 when greedy: p is one-hot there), for ``Drafter.judge``."""

    #: Tokens judged at most, the newest (the acceptance estimate remembers 16 rounds).
    JUDGED = 32

    def __init__(self, start: int):
        self.start, self.logp = start, []

    def add(self, logp: mx.array | None) -> None:
        self.logp.append(0.0 if logp is None else logp.item())

    def judge(self, drafter: Drafter, history: list[int], sampling: SamplingParams) -> list[float] | None:
        """min(1, q/p) of each judged token (an unbiased estimate of its acceptance Σ min(p, q)), or ``None``;
        the stretch then starts again after them."""
        start = max(self.start, len(history) - self.JUDGED)
        logq = drafter.judge(history, start, sampling) if start < len(history) else None
        self.start, logp, self.logp = len(history), self.logp[start - self.start :], []
        if logq is None:
            return None
        return np.minimum(1.0, np.exp(np.array(logq, dtype=np.float64) - np.array(logp))).tolist()
