"""The server's side of the runner (``engine.runner.Runner``): jobs from HTTP in, records back to their loop.

The runner owns the model's thread, admits requests, batches them (continuous batching with exact speculation
per row, ``serve --max-batch``) and streams each one's rounds; this adapter turns a ``Job`` into a runner
``Request`` and each round into a ``Delta`` posted to the job's event loop with ``call_soon_threadsafe``. The
queue is bounded: a full queue refuses at once (the server answers 503 with ``Retry-After``). A request stops
after its current round (or prefill chunk) when it is cancelled (its client went away) or its deadline passes.

A sharded target (``serve --shard``, docs/distributed.md) runs its requests one at a time on every rank in
lockstep (the runner shares rank 0's requests); a failed collective (a rank died) ends the runner: the server
stops with one line, status 2.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.sampling import SamplingParams
from ..engine.output import Committed
from ..engine.runner import DEFAULT_MAX_BATCH, Done, Failed, QueueFull, Request, Runner, Setup
from .prefix_cache import PrefixCache

__all__ = ["DEFAULT_MAX_BATCH", "Delta", "Done", "Failed", "Job", "QueueFull", "Served", "Worker"]


@dataclass(frozen=True)
class Delta:
    """Text one round committed (``""`` when its tokens only start a character), its token count, and
    the prompt tokens the prefix cache held."""

    text: str
    tokens: int
    cached: int = 0


@dataclass
class Job:
    """One generation request, made on the HTTP side.

    Attributes:
        prompt: Token ids (chat template applied).
        max_tokens: Most tokens to generate.
        sampling: Temperature and filters.
        seed: ``mx.random`` seed, or ``None``.
        stop: Stop strings.
        deadline: ``time.monotonic()`` after which it stops after its current round.
        loop: The event loop whose ``events`` queue receives ``Delta``, ``Done`` and ``Failed``.
        cancelled: Set to stop it after its current round (or before it starts).
        created: ``time.monotonic()`` when it was made; ``first_token``: when its first text was posted.
    """

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: list[str]
    deadline: float
    loop: asyncio.AbstractEventLoop | None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.monotonic)
    first_token: float | None = None

    def post(self, item) -> None:
        """Hand ``item`` to the HTTP side (from the worker thread); a following rank's job posts nothing."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


@dataclass
class Served:
    """What the loaded model is, for the HTTP side (set once loading ends; plain Python objects only).

    Attributes:
        model_id: The name requests use (``GET /v1/models``).
        tokenizer: The target's tokenizer (its encode and chat template are used on the HTTP side).
        context: The model's context window in tokens, or ``None``.
        drafter: The drafter's name.
        eos: The ids that end an answer.
    """

    model_id: str
    tokenizer: object
    context: int | None
    drafter: str
    eos: frozenset[int]


class Worker:
    """Owns the runner that owns the model's thread.

    Args:
        load: Called on the runner thread; returns ``(target_model, tokenizer, drafter, policy, served)``. A
            user error (``ValueError``, ``FileNotFoundError``...) it raises is kept in ``error`` and raised by
            ``start``.
        queue_size: Most requests waiting to start (the running ones not counted).
        prefix_cache: ``(slots, max_bytes)`` of the prefix cache.
        on_done: Called on the runner thread with each finished ``Job`` and its ``Done`` (metrics).
        max_batch: Most requests decoding together (``serve --max-batch``; 1: one at a time).
    """

    def __init__(self, load: Callable[[], tuple], queue_size: int = 16,
                 prefix_cache: tuple[int, int] = (4, 2 << 30), on_done: Callable | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH):
        if queue_size < 1:
            raise ValueError(f"--queue-size must be >= 1, got {queue_size}")
        self._load, self._cache_bounds, self._on_done = load, prefix_cache, on_done
        self.runner = Runner(max_batch=max_batch, queue_size=queue_size, name="mlxspec-serve-runner")
        self.served: Served | None = None
        self.prefix_cache: PrefixCache | None = None
        self._load_error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        """What stopped the worker: a loading error, or a failed collective of a sharded target."""
        return self._load_error or self.runner.error

    @property
    def on_failure(self) -> Callable[[BaseException], None] | None:
        """Called once when a sharded job loses a rank."""
        return self.runner.on_failure

    @on_failure.setter
    def on_failure(self, value) -> None:
        self.runner.on_failure = value

    def start(self) -> Served:
        """Start the runner and load the model on its thread.

        Raises:
            Whatever loading raised.
        """
        self.runner.start()
        try:
            self.runner.call(self._setup)
        except KeyboardInterrupt:  # mid-load in MLX: the caller exits at once (closing waits for the load)
            raise
        except BaseException as e:
            self._load_error = e
            self.runner.close()  # MLX state released on its thread first (exiting sooner raced MLX's abort)
            raise
        return self.served

    def _setup(self) -> None:
        model, tokenizer, drafter, policy, self.served = self._load()
        self.prefix_cache = PrefixCache(model, *self._cache_bounds)
        self.runner.use(Setup(model, tokenizer, drafter, policy, self.prefix_cache))

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            QueueFull: the queue is full (answer 503).
        """
        request = Request(job.prompt, job.max_tokens, job.sampling, job.seed, job.stop, self._sink(job),
                          job.deadline, job.cancelled)
        self.runner.submit(request)

    def _sink(self, job: Job) -> Callable[[object], None]:
        """What the runner calls with the job's records (on its thread): ``Delta`` per round, then
        ``Done``/``Failed``."""

        def sink(item) -> None:
            if isinstance(item, Committed):
                if item.events:
                    if job.first_token is None:
                        job.first_token = time.monotonic()
                    job.post(Delta(item.text, len(item.events), item.totals.cached_tokens))
                return
            job.post(item)
            if isinstance(item, Done) and self._on_done is not None:
                self._on_done(job, item)

        return sink

    @property
    def queued(self) -> int:
        """Requests waiting, the running ones not counted."""
        return self.runner.queued

    @property
    def rows(self) -> int:
        """Requests running (prefilling or decoding)."""
        return self.runner.rows

    @property
    def busy(self) -> bool:
        """Whether a request is running."""
        return self.runner.rows > 0

    def cancel_all(self) -> None:
        """Cancel the running and queued requests (each ends after its current round, or at once)."""
        self.runner.cancel_all()

    def wait(self) -> None:
        """Wait until the runner stops (a following rank: until rank 0's server stops, or the job fails)."""
        while not self.runner.join(1.0):  # in steps, so the main thread still handles signals
            pass

    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel every request, stop the runner; returns whether it stopped in time."""
        return self.runner.close(timeout_s)
