"""The one thread that owns the model: loads it, then runs queued requests first come, first served.

Shaped like the chat's engine (``app/engine.py``) and mlx-lm's ``ResponseGenerator``: every MLX call
happens on this thread (an MLX stream made on one thread cannot be used from another), and results
go back to the HTTP side's event loop with ``call_soon_threadsafe``. The queue is bounded: a full
queue refuses at once (the server answers 503 with ``Retry-After``). A request stops after its
current round when it is cancelled (its client went away) or its deadline passes; a prefill cannot
be interrupted. Batching several requests into one forward is not done: one request runs at a time.

A sharded target (``serve --shard``, docs/distributed.md) runs on every rank of an ``mlx.launch`` job in
lockstep: rank 0's worker takes each request from its queue and shares it (prompt, limits, sampling,
seed, stops: ``distributed.share_json``) with the other ranks' workers, which run the same generation and
post nothing; after every round all ranks agree whether to stop (rank 0's cancellation or deadline).
While idle, rank 0 tells the others so every ``IDLE_TICK_S``, so they wait in Python, not in a collective.
A failed collective (a rank died) ends the worker: the server stops with one line, status 2.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..engine.generate import stream_generate
from ..core.metrics import RoundStats, GenerationStats, TokenEvent
from ..core.sampling import SamplingParams
from ..engine.session import USER_ERRORS
from ..runtime.distributed import any_rank, random_seed, share_json, sharding
from ..runtime.threads import MLXThread
from .prefix_cache import PrefixCache


#: Seconds rank 0's worker of a sharded server waits for a request before telling the other ranks it has none.
IDLE_TICK_S = 1.0


class QueueFull(Exception):
    """The worker's queue holds as many requests as it may."""


@dataclass(frozen=True)
class Delta:
    """Text one round committed (``""`` when its tokens only start a character), its token count, and
    the prompt tokens the prefix cache held."""

    text: str
    tokens: int
    cached: int = 0


@dataclass(frozen=True)
class Done:
    """The end of a request.

    Attributes:
        stats: The run's totals (``cached_tokens``: prompt tokens the prefix cache held).
        finish_reason: ``"stop"`` (a stop token or string), ``"length"`` (``max_tokens``, the context,
            or the request's timeout) or ``"cancelled"``.
        stop_string: Whether a stop string (not a stop token) ended it.
        timed_out: Whether the request's deadline ended it.
    """

    stats: GenerationStats
    finish_reason: str
    stop_string: bool = False
    timed_out: bool = False


@dataclass(frozen=True)
class Failed:
    """A request the library refused (``status`` 400, e.g. a token id outside the vocabulary) or that
    failed (500)."""

    message: str
    status: int


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
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.monotonic)
    first_token: float | None = None

    def shared(self) -> dict:
        """What another rank needs to run this request too (``following``), as JSON."""
        sampling = {k: getattr(self.sampling, k) for k in SHARED_SAMPLING}
        return {"prompt": list(self.prompt), "max_tokens": self.max_tokens, "sampling": sampling, "seed": self.seed,
                "stop": list(self.stop)}

    @classmethod
    def following(cls, shared: dict) -> Job:
        """Another rank's copy of rank 0's request: no deadline, and nothing to post to."""
        return cls(shared["prompt"], shared["max_tokens"], SamplingParams(**shared["sampling"]), shared["seed"],
                   shared["stop"], math.inf, None)

    def post(self, item) -> None:
        """Hand ``item`` to the HTTP side (from the worker thread); a following rank's job posts nothing."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


#: The ``SamplingParams`` fields a request sets (its logits processors are built from them).
SHARED_SAMPLING = ("temp", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size")


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
    """Owns the model's thread.

    Args:
        load: Called on the worker thread; returns ``(target_model, tokenizer, drafter, policy, served)``.
            A user error (``ValueError``, ``FileNotFoundError``...) it raises is kept in ``error``.
        queue_size: Most requests waiting (the running one not counted).
        prefix_cache: ``(slots, max_bytes)`` of the prefix cache.
        on_done: Called on the worker thread with each finished ``Job`` and its ``Done`` (metrics).
    """

    def __init__(self, load: Callable[[], tuple], queue_size: int = 16,
                 prefix_cache: tuple[int, int] = (4, 2 << 30), on_done: Callable | None = None):
        if queue_size < 1:
            raise ValueError(f"--queue-size must be >= 1, got {queue_size}")
        self._load, self._cache_bounds, self._on_done = load, prefix_cache, on_done
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._ready = threading.Event()
        self._thread = MLXThread(self._serve, name="mlxspec-serve-worker")  # exits cleanly (mlxspec.runtime.threads)
        self._running: Job | None = None
        self.served: Served | None = None
        self.error: BaseException | None = None
        self.prefix_cache: PrefixCache | None = None
        self.on_failure: Callable[[BaseException], None] | None = None  # a sharded job lost a rank (called once)
        self._group = None  # the ranks of a sharded target, set once it is loaded

    def start(self) -> Served:
        """Start the thread and wait until the model is loaded.

        Raises:
            Whatever loading raised.
        """
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            self._thread.join()  # its MLX state released on it first: exiting sooner raced MLX's abort at exit
            raise self.error
        return self.served

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            QueueFull: the queue is full (answer 503).
        """
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    @property
    def queued(self) -> int:
        """Requests waiting, the running one not counted."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        """Whether a request is running."""
        return self._running is not None

    def cancel_all(self) -> None:
        """Cancel the running and queued requests (each ends after its current round, or at once)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.post(Done(GenerationStats(), "cancelled"))
        if self._running is not None:
            self._running.cancelled.set()

    def wait(self) -> None:
        """Wait until the thread stops (a following rank: until rank 0's server stops, or the job fails)."""
        while not self._thread.join(1.0):  # in steps, so the main thread still handles signals
            pass

    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel every request, stop the thread; returns whether it stopped in time."""
        self.cancel_all()
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # Everything below runs on the worker thread.

    def _serve(self) -> None:
        try:
            self._run()
        finally:  # the model and caches are released here, on the thread that made them
            self._model = self._tokenizer = self._drafter = self._policy = self.prefix_cache = None

    def _run(self) -> None:
        with mx.stream(mx.new_thread_local_stream(mx.default_device())):
            try:
                self._model, self._tokenizer, self._drafter, self._policy, self.served = self._load()
                self.prefix_cache = PrefixCache(self._model, *self._cache_bounds)
                self._group = sharding(self._model).group if sharding(self._model) else None
            except BaseException as e:  # noqa: B036 - handed to the starting thread, which raises it
                self.error = e
                return
            finally:
                self._ready.set()
            try:
                self._loop()
            except Exception as e:  # a sharded job's collective failed: the ranks are no longer in step
                self.error = e
                if self.on_failure is not None:
                    self.on_failure(e)

    def _loop(self) -> None:
        while (job := self._next_job()) is not None:
            self._running = job
            try:
                done = self._generate(job)
            except Exception as e:  # a bug must not kill the thread: every later request would hang
                done = None
                job.post(Failed(f"internal error: {type(e).__name__}: {e}", 500))
                if self._group is not None:
                    raise
            finally:
                self._running = None
            if done is not None and self._on_done is not None:
                self._on_done(job, done)

    def _next_job(self) -> Job | None:
        """The next request (``None``: stop): from the queue; for a sharded target, rank 0's, on every rank."""
        if self._group is None:
            return self._queue.get()
        if self._group.rank() != 0:
            while (shared := share_json(self._group)) == "idle":
                pass
            return None if shared is None else Job.following(shared)
        while True:
            try:
                job = self._queue.get(timeout=IDLE_TICK_S)
                break
            except queue.Empty:
                share_json(self._group, "idle")
        if job is not None and job.seed is None:  # every rank must draw alike: rank 0 picks the seed
            job.seed = random_seed()
        share_json(self._group, None if job is None else job.shared())
        return job

    def _ending(self, job: Job) -> bool:
        """Whether ``job`` stops here (cancelled, or past its deadline); for a sharded target, agreed by all ranks."""
        ending = job.cancelled.is_set() or time.monotonic() > job.deadline
        return ending if self._group is None else any_rank(self._group, ending)

    def _generate(self, job: Job) -> Done | None:
        if self._ending(job):
            done = Done(GenerationStats(prompt_tokens=len(job.prompt)), "cancelled", timed_out=not job.cancelled.is_set())
            job.post(done)
            return done
        slot = self.prefix_cache.take(job.prompt)
        events = stream_generate(
            self._model, self._tokenizer, job.prompt, drafter=self._drafter, num_draft_tokens=self._policy,
            max_tokens=job.max_tokens, sampling=job.sampling, seed=job.seed, stop=job.stop or None,
            prompt_cache=slot,
        )
        gamma = self._policy if isinstance(self._policy, int) else self._policy.max_gamma
        totals = GenerationStats(drafter=self._drafter.name, num_draft_tokens=gamma, prompt_tokens=len(job.prompt))
        texts, count, last, stopped = [], 0, None, None
        try:
            for event in events:
                if isinstance(event, TokenEvent):
                    texts.append(event.text)
                    count, last = count + 1, event.token
                elif isinstance(event, RoundStats):
                    totals.add_round(event)
                    if getattr(self._policy, "adaptive", False):  # as stream_generate counts them in its totals
                        totals.add_gamma(event.gamma)
                    if event.round == 0:
                        totals.cached_tokens = slot.reused
                    self._post_text(job, texts, count, slot.reused)
                    texts, count = [], 0
                    if self._ending(job):
                        stopped = "cancelled" if job.cancelled.is_set() else "timeout"
                        break
                elif isinstance(event, GenerationStats):
                    totals = event
        except USER_ERRORS as e:  # refused before anything ran (e.g. a token id outside the vocabulary)
            job.post(Failed(" ".join(str(e).split()), 400))
            return None
        finally:  # on an error the slot may be half-updated: it is not kept
            events.close()  # its finally leaves the caches at what was committed
        self.prefix_cache.release(slot)
        if stopped is None:
            reason = totals.finish_reason or "length"
            done = Done(totals, reason, stop_string=reason == "stop" and last not in self.served.eos)
        else:  # the rounds' own time stands for the decode time stream_generate would have measured
            totals.generation_s = totals.draft_s + totals.verify_s
            done = Done(totals, "cancelled" if stopped == "cancelled" else "length", timed_out=stopped == "timeout")
        job.post(done)
        return done

    @staticmethod
    def _post_text(job: Job, texts: list[str], count: int, cached: int) -> None:
        if count:
            if job.first_token is None:
                job.first_token = time.monotonic()
            job.post(Delta("".join(texts), count, cached))
