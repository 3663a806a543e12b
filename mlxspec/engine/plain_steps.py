"""The round loop's plain steps, pipelined as in ``mlx_lm.generate_step``."""

from __future__ import annotations

import mlx.core as mx

from ..core.cache import trim
from ..core.taps import HiddenTap
from ..core.sampling import SamplingParams, process_logits, sample
from ..runtime.distributed import sharding


class PlainSteps:
    """Plain decoding steps, pipelined as in ``mlx_lm.generate_step``.

    ``take`` returns the next token (lazy) and, with a ``tap``, the features of the step's input (lazy,
    [1, F]): the step queued by ``queue``, or a new forward over the root. ``queue`` builds the
    following step from a lazy token and ``mx.async_eval``s it, so its forward runs while the host
    reads the current token. A queued step has written its input (the newest committed token) into
    the cache; ``cancel`` trims it when no step follows. The features are taken from the tap as each
    forward is built, since a queued forward records over the previous one's.

    A target split into pipeline stages (``loading.sharded.shard``) steps without queuing: its ranks hung when
    a queued step's send/recv was evaluated asynchronously beside the current one (2 ranks, ring backend).
    """

    def __init__(self, model, cache, sampling: SamplingParams, tap: HiddenTap | None = None):
        self.model, self.cache, self.sampling, self.tap = model, cache, sampling, tap
        self.processors = sampling.processors()
        self.queued: tuple[mx.array, mx.array | None] | None = None
        split = sharding(model)
        self.lookahead = split is None or split.kind != "pipeline"

    def _step(self, inputs: mx.array, context) -> tuple[mx.array, mx.array | None]:
        logits = self.model(inputs[None], cache=self.cache)[0, -1:]  # [1, V]
        hidden = self.tap.features()[0] if self.tap is not None else None  # [1, F]
        if self.processors:
            logits = process_logits(logits, context(), self.processors)
        return sample(logits, self.sampling)[0], hidden  # [1] int32, lazy

    def round(
        self, history: list[int], queue: bool
    ) -> tuple[list[int], list[int], list[str], mx.array | None]:
        """One plain round: the next token (the round's one sync), the next step queued first when ``queue``;
        returns ``(path, tokens, kinds, hidden)`` as a verify does."""
        token, hidden = self.take(history)
        if queue and self.lookahead:
            self.queue(token, history)
        mx.eval(token, hidden)
        return [], [token.item()], ["target"], hidden

    def take(self, history: list[int]) -> tuple[mx.array, mx.array | None]:
        step, self.queued = self.queued, None
        if step is None:
            step = self._step(
                mx.array(history[-1:], dtype=mx.int32), lambda: mx.array(history, dtype=mx.int32)
            )
        return step

    def queue(self, token: mx.array, history: list[int]) -> None:
        self.queued = self._step(token, lambda: mx.concatenate([mx.array(history, dtype=mx.int32), token]))
        mx.async_eval(*(a for a in self.queued if a is not None))

    def cancel(self) -> None:
        if self.queued is not None:
            self.queued = None
            trim(self.cache, 1)
