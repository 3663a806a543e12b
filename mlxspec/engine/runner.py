"""The runner: one MLX thread that owns the target, admits generations and runs them, batched when it can.

Shaped like mlx-lm's ``BatchGenerator`` behind its server, with exact speculation inside the batch
(``batch.Batch``). Consumers (the server's worker, the chat's engine) ``submit`` a ``Request`` and receive its
records through the request's ``sink``, called on the runner thread: a ``Committed`` per round (tokens and
running totals), then one ``Done`` or ``Failed``. Every MLX call happens on this thread (an MLX stream made on
one thread cannot be used from another); ``call`` runs other work there (loading, switching models).

Continuous batching: generations join and leave between rounds. A new prompt is prefilled ``prefill_chunk``
tokens at a time, one chunk between two rounds of the rows already decoding, so a long prompt delays their
next token by about one chunk; a request cancelled (or past its deadline) mid-prefill is dropped within one
chunk. Up to ``max_batch`` generations decode together; the rest wait in a bounded queue (``QueueFull`` past
it).

Generations run one at a time, through ``generate.committed_rounds``, when the drafter cannot run beside
itself (``Drafter.fork`` is ``None``: Medusa, DFlash, DSpark, MTP), when the target's caches are not all plain
``KVCache``s (sliding windows, recurrent layers), for a sharded target, or with ``max_batch=1``.

A sharded target (docs/distributed.md) runs on every rank in lockstep: rank 0 shares each request (prompt,
limits, sampling, seed, stops) with the other ranks' runners, which run the same generation and post nothing;
after every round all ranks agree whether to stop. While idle, rank 0 says so every ``IDLE_TICK_S``.
"""

from __future__ import annotations

import copy
import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mlx_lm.models.cache import make_prompt_cache

from ..core.cache import PromptCache, check_compactable, check_rewindable
from ..core.metrics import GenerationStats
from ..core.sampling import SamplingParams
from ..core.stops import StopStrings, check_stops
from ..core.taps import HiddenTap
from ..drafters import Drafter
from ..pacing import Auto, Pacer, load_or_calibrate, make_pacer
from ..runtime.distributed import any_rank, random_seed, share_json, sharding
from ..runtime.threads import MLXThread
from .arguments import check_prompt, check_types, is_int
from .batch import Batch, Row, batchable_layers
from .generate import (
    GenerationResult,
    check_context,
    check_ids,
    committed_rounds,
    context_length,
    encode_prompt,
    make_verifier,
)
from .output import Committed, Output
from .session import USER_ERRORS

#: Prompt tokens prefilled between two rounds of the decoding rows.
DEFAULT_PREFILL_CHUNK = 512
#: Generations decoding together by default (``serve --max-batch``).
DEFAULT_MAX_BATCH = 8
#: Seconds rank 0 of a sharded target waits for a request before telling the other ranks it has none.
IDLE_TICK_S = 1.0
#: The ``SamplingParams`` fields a request sets (its logits processors are built from them).
SHARED_SAMPLING = ("temp", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size")


class QueueFull(Exception):
    """The runner's queue holds as many requests as it may."""


@dataclass(frozen=True)
class Done:
    """The end of a request.

    Attributes:
        stats: The run's totals (``cached_tokens``: prompt tokens the prefix cache held).
        finish_reason: ``"stop"`` (a stop token or string), ``"length"`` (``max_tokens``, the context, or the
            request's timeout) or ``"cancelled"``.
        stop_string: Whether a stop string (not a stop token) ended it.
        timed_out: Whether the request's deadline ended it.
    """

    stats: GenerationStats
    finish_reason: str
    stop_string: bool = False
    timed_out: bool = False


@dataclass(frozen=True)
class Failed:
    """A request the library refused (``status`` 400, e.g. a token id outside the vocabulary) or that failed
    (500)."""

    message: str
    status: int


@dataclass
class Request:
    """One generation to run.

    Attributes:
        prompt: Token ids (chat template applied).
        max_tokens: Most tokens to generate.
        sampling: Temperature and filters.
        seed: Seed of its random draws, or ``None``.
        stop: Stop strings.
        sink: Called on the runner thread with each ``Committed``, then one ``Done`` or ``Failed``.
        deadline: ``time.monotonic()`` after which it stops after its current round. Default: none.
        cancelled: Set to stop it after its current round (or its current prefill chunk, or before it starts).
        reuse: Whether it may take a slot of the prefix cache (a conversation's cache). Default: ``True``.
        cache: A ``PromptCache`` of its own to generate into and reuse (a chat's conversation), instead of a
            slot of the prefix cache. Default: ``None``.
        typical: ``(threshold, alpha)`` for Medusa's LOSSY typical acceptance (``generate.make_verifier``), or
            ``None`` (exact). Default: ``None``.
        last: The last token committed so far (set by the runner).
    """

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...] | list[str]
    sink: Callable[[object], None] | None
    deadline: float = math.inf
    cancelled: threading.Event = field(default_factory=threading.Event)
    reuse: bool = True
    cache: PromptCache | None = None
    typical: tuple[float, float] | None = None
    last: int | None = None  # the last token committed (set by the runner)

    def shared(self) -> dict:
        """What another rank needs to run this request too (``following``), as JSON."""
        sampling = {k: getattr(self.sampling, k) for k in SHARED_SAMPLING}
        return {
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "sampling": sampling,
            "seed": self.seed,
            "stop": list(self.stop),
        }

    @classmethod
    def following(cls, shared: dict) -> Request:
        """Another rank's copy of rank 0's request: no deadline, and nothing to post to."""
        return cls(
            shared["prompt"],
            shared["max_tokens"],
            SamplingParams(**shared["sampling"]),
            shared["seed"],
            shared["stop"],
            None,
        )

    def post(self, item) -> None:
        if self.sink is not None:
            self.sink(item)

    def ending(self) -> bool:
        """Whether it should stop now (cancelled, or past its deadline)."""
        return self.cancelled.is_set() or time.monotonic() > self.deadline

    @property
    def why(self) -> str:
        """Why an ending request stops: ``"cancelled"`` or ``"timeout"``."""
        return "cancelled" if self.cancelled.is_set() else "timeout"


@dataclass
class Setup:
    """What the runner generates with (made on the runner thread, by the ``load`` given to ``Runner.call``).

    Attributes:
        model, tokenizer: The target and its tokenizer.
        drafter: The drafter; each batched generation runs a ``fork`` of it.
        pacer: The γ policy (``pacing.make_pacer``); a batched generation runs a copy of it, and the copy of
            the generation that ended last becomes it (what γ auto learned carries over, as in one-at-a-time
            runs).
        prefix_cache: Slots of earlier prompts to reuse (``serve.prefix_cache.PrefixCache``-like: ``take``,
            ``release``), or ``None`` (a fresh cache per request).
    """

    model: nn.Module
    tokenizer: object
    drafter: Drafter
    pacer: Pacer
    prefix_cache: object = None


@dataclass
class _Pending:
    """A request being prefilled: its slot, the tokens left, its time so far."""

    request: Request
    store: PromptCache
    left: list[int]
    prefill_s: float = 0.0


class Runner:
    """Owns the MLX thread.

    Args:
        max_batch: Most generations decoding together (1: one at a time). Default: ``DEFAULT_MAX_BATCH``.
        queue_size: Most requests waiting to start. Default: 16.
        prefill_chunk: Prompt tokens prefilled between two rounds. Default: ``DEFAULT_PREFILL_CHUNK``.
        on_done: Called on the runner thread with each finished ``Request`` and its ``Done`` (metrics).
        name: The thread's name.

    Raises:
        ValueError: ``max_batch``, ``queue_size`` or ``prefill_chunk`` below 1.
    """

    def __init__(self, *, max_batch: int = DEFAULT_MAX_BATCH, queue_size: int = 16,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, on_done: Callable | None = None,
                 name: str = "mlxspec-runner"):
        for flag, value in (("max_batch", max_batch), ("queue_size", queue_size),
                            ("prefill_chunk", prefill_chunk)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        self.max_batch, self.prefill_chunk, self._on_done = max_batch, prefill_chunk, on_done
        # bounded in ``submit``: ``queue_size`` waiting behind the generations that run or are about to
        self._queue: queue.Queue = queue.Queue()
        self.queue_size, self._submit_lock = queue_size, threading.Lock()
        self._calls: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._thread = MLXThread(self._main, name=name)
        self.setup: Setup | None = None
        self.error: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = (
            None  # a sharded job lost a rank (called once)
        )
        self._running: list[Request] = []  # prefilling or decoding
        self._group = None
        self._closing = False
        self._batch: Batch | None = None
        self._pending: list[_Pending] = []
        self._followers_told = False  # rank 0 of a sharded target told the other ranks to stop
        self.forwards = 0  # target forwards of rounds (a batch's round is one)
        self.tokens = 0  # tokens those rounds committed
        self.prefill_tokens = 0  # prompt tokens prefilled by the batched path's chunks

    # The consumer's side (any thread).

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def call(self, fn: Callable, *args, wait: bool = True) -> object:
        """Run ``fn(*args)`` on the runner thread between rounds; with ``wait``, wait for it and return what
        it returns (else return at once: ``fn`` must report its own errors).

        Raises:
            Whatever ``fn`` raised (with ``wait``).
        """
        done, box = threading.Event(), {}
        self._calls.put((fn, args, done, box))
        self._wake.set()
        if not wait:
            return None
        while not done.wait(1.0):  # in steps, so the calling thread still handles signals
            if not self._thread.is_alive():
                raise RuntimeError("the runner thread has stopped")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def submit(self, request: Request) -> None:
        """Queue ``request``: it starts at the runner's next step when fewer than ``max_batch`` generations
        run (one, when they run one at a time), else waits.

        Raises:
            QueueFull: ``queue_size`` requests already wait beyond the free places (the server answers 503).
        """
        with self._submit_lock:
            free = max((self.max_batch if self.batched else 1) - len(self._running), 0)
            if self._queue.qsize() >= self.queue_size + free:
                raise QueueFull
            self._queue.put_nowait(request)
        self._wake.set()

    @property
    def queued(self) -> int:
        """Requests waiting to start."""
        return self._queue.qsize()

    @property
    def rows(self) -> int:
        """Generations running (prefilling or decoding)."""
        return len(self._running)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens committed per target forward of a round since the start (rows × τ; 0 before any)."""
        return self.tokens / self.forwards if self.forwards else 0.0

    def cancel_all(self) -> None:
        """Cancel the running and queued requests (each ends after its current round or chunk, or at once)."""
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                break
            if request is not None:
                request.cancelled.set()
                request.post(Done(GenerationStats(prompt_tokens=len(request.prompt)), "cancelled"))
        for request in list(self._running):
            request.cancelled.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the thread stopped; returns whether it did in time."""
        return self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel every request, stop the thread; returns whether it stopped in time."""
        self._closing = True
        self.cancel_all()
        self._wake.set()
        return self._thread.join(timeout_s)

    # Everything below runs on the runner thread.

    def _main(self) -> None:
        with mx.stream(mx.new_thread_local_stream(mx.default_device())):
            try:
                self._loop()
            except Exception as e:  # a sharded job's collective failed: the ranks are no longer in step
                self.error = e
                if self.on_failure is not None:
                    self.on_failure(e)
            finally:  # the models and caches are released here, on the thread that made them
                self.setup = self._batch = None

    def _run_calls(self) -> None:
        while True:
            try:
                fn, args, done, box = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: B036 - handed to the calling thread, which raises it
                box["error"] = e
            finally:
                done.set()

    def use(self, setup: Setup) -> None:
        """Generate with ``setup`` from now on (call it through ``call``; nothing may be running). Its
        ``pacer`` may also be what ``pacing.make_pacer`` takes (an integer γ, ``"auto"``)."""
        setup.pacer = make_pacer(setup.pacer, setup.model, setup.drafter)
        self.setup = setup
        model, drafter = setup.model, setup.drafter
        self._group = sharding(model).group if sharding(model) else None
        batched = (self.max_batch > 1 and self._group is None and drafter.fork() is not None
                   and batchable_layers(make_prompt_cache(model)))
        if batched and isinstance(setup.pacer, Auto) and setup.pacer.costs.rows_s is None:
            # what verifying R rows × k tokens costs, for pacing.BatchGate (measured once per machine)
            setup.pacer.costs.rows_s = load_or_calibrate(model, rows=True, on_measure=_say_measuring).rows_s
        tap = HiddenTap(model, layers=drafter.feature_layers) if batched and drafter.needs_hidden else None
        self._batch = Batch(model, tap) if batched else None
        self._pending = []
        # drafters free for the next row, most recently used last: a drafter keeps what it holds of the prompt
        # it last ran (a draft model's cache), so the next prompt re-reads only what differs, as one-at-a-time
        # runs do
        self._idle = [drafter] if batched else []

    @property
    def batched(self) -> bool:
        """Whether generations decode together (see the module docstring for when they cannot)."""
        return self._batch is not None

    def drain(self) -> None:
        """Run the loop in the calling thread until nothing is queued or running (``batch_generate``: a runner
        that was never started, whose ``use`` was called in this thread)."""
        while self._queue.qsize() or self._running:
            self._tick(wait=False)

    def _loop(self) -> None:
        while not self._closing:
            self._run_calls()
            if self.setup is None:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self._tick(wait=True)
        self._run_calls()  # what was asked before the close (the chat releases its models here)
        if self._group is not None and self._group.rank() == 0 and not self._followers_told:
            share_json(self._group, None)  # the other ranks stop too

    def _tick(self, wait: bool) -> None:
        """One step: a whole request one at a time; or admit, one prefill chunk and one round of the batch.
        With ``wait``, an idle runner waits (up to ``IDLE_TICK_S``) for a request or a call."""
        if self._batch is None:
            request = self._next_serial(wait)
            if request is not None:
                self._running = [request]
                try:
                    self._serial(request)
                finally:
                    self._running = []
            return
        self._admit()
        if self._pending:
            self._prefill_chunk()
        self._drop_ending()
        if len(self._batch):
            self._round()
        if wait and not self._running:
            self._wake.wait(IDLE_TICK_S)
            self._wake.clear()

    # One at a time.

    def _next_serial(self, wait: bool = True) -> Request | None:
        """The next request, or ``None`` (after a short wait, with ``wait``); for a sharded target, rank 0's,
        on every rank."""
        if self._group is None:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                if wait:
                    self._wake.wait(IDLE_TICK_S)  # a submit or a call sets it
                    self._wake.clear()
                return None
        if self._group.rank() != 0:
            shared = share_json(self._group)
            if shared is None:
                self._closing = True
                return None
            return None if shared == "idle" else Request.following(shared)
        try:
            request = self._queue.get(timeout=IDLE_TICK_S)
        except queue.Empty:
            self._followers_told = closing = self._closing  # read once: another thread sets it
            share_json(self._group, None if closing else "idle")
            return None
        if request.seed is None:  # every rank must draw alike: rank 0 picks the seed
            request.seed = random_seed()
        share_json(self._group, request.shared())
        return request

    def _ending(self, request: Request) -> bool:
        """Whether ``request`` stops here; for a sharded target, agreed by all ranks."""
        ending = request.ending()
        return ending if self._group is None else any_rank(self._group, ending)

    def _serial(self, request: Request) -> None:
        """Run one request to its end through ``generate.committed_rounds``."""
        setup = self.setup
        if self._ending(request):
            return self._finish(request, GenerationStats(prompt_tokens=len(request.prompt)), request.why)
        slot = self._take_slot(request)
        rounds = committed_rounds(
            setup.model,
            setup.tokenizer,
            request.prompt,
            drafter=setup.drafter,
            num_draft_tokens=setup.pacer,
            max_tokens=request.max_tokens,
            sampling=request.sampling,
            seed=request.seed,
            stop=request.stop or None,
            prompt_cache=slot,
            typical=request.typical,
        )
        totals, stopped = None, None
        try:
            for committed in rounds:
                totals = committed.totals
                self.forwards, self.tokens = self.forwards + 1, self.tokens + len(committed.events)
                request.last = committed.events[-1].token if committed.events else request.last
                request.post(committed)
                if not committed.finish_reason and self._ending(request):
                    stopped = request.why
                    totals.generation_s = totals.draft_s + totals.verify_s  # the rounds' own time
                    break
        except USER_ERRORS as e:  # refused before anything ran (e.g. a token id outside the vocabulary)
            return request.post(Failed(" ".join(str(e).split()), 400))
        except Exception as e:  # a bug must not kill the thread: every later request would hang
            request.post(Failed(f"internal error: {type(e).__name__}: {e}", 500))
            if self._group is not None:
                raise
            return None
        finally:
            rounds.close()  # its finally leaves the caches at what was committed
        self._release_slot(request, slot)
        self._finish(request, totals or GenerationStats(prompt_tokens=len(request.prompt)), stopped)

    # Batched.

    def _admit(self) -> None:
        """Start prefilling queued requests while fewer than ``max_batch`` run."""
        while len(self._batch) + len(self._pending) < self.max_batch:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return
            if request.ending():
                self._finish(request, GenerationStats(prompt_tokens=len(request.prompt)), request.why)
                continue
            try:
                self._start(request)
            except USER_ERRORS as e:
                request.post(Failed(" ".join(str(e).split()), 400))

    def _start(self, request: Request) -> None:
        """Check ``request`` as ``committed_rounds`` would and queue its prefill."""
        setup = self.setup
        request.prompt = encode_prompt(setup.tokenizer, request.prompt)  # Python ints (numpy ids come in too)
        check_context(setup.model, len(request.prompt))
        check_ids(setup.model, request.prompt)
        request.stop = check_stops(request.stop or None)
        limit = context_length(setup.model)
        if limit:
            request.max_tokens = min(request.max_tokens, limit - len(request.prompt))
        store = self._take_slot(request)
        tap = self._batch.tap
        reused = store.reuse(request.prompt, setup.drafter.feature_layers if tap is not None else None)
        self._running.append(request)
        self._pending.append(_Pending(request, store, request.prompt[reused:-1]))

    def _prefill_chunk(self) -> None:
        """Prefill one chunk of the pending prompt with the fewest tokens left (a short prompt arriving behind
        a long one starts within a chunk); a prompt prefilled whole joins the batch. A prompt that fails is
        refused alone (400 for a user error, 500 for a bug); the thread and the other rows go on."""
        pending = min(self._pending, key=lambda p: len(p.left))
        try:
            self._prefill_step(pending)
        except Exception as e:
            if pending in self._pending:
                self._pending.remove(pending)
            self._running.remove(pending.request)
            user = isinstance(e, USER_ERRORS)
            message = " ".join(str(e).split()) if user else f"internal error: {type(e).__name__}: {e}"
            pending.request.post(Failed(message, 400 if user else 500))

    def _prefill_step(self, pending: _Pending) -> None:
        if pending.request.ending():
            self._pending.remove(pending)
            self._running.remove(pending.request)
            return self._finish(pending.request, GenerationStats(prompt_tokens=len(pending.request.prompt)),
                                pending.request.why)
        start, tap = time.perf_counter(), self._batch.tap
        chunk, pending.left = pending.left[: self.prefill_chunk], pending.left[self.prefill_chunk :]
        if chunk:
            self.setup.model(mx.array(chunk, dtype=mx.int32)[None], cache=pending.store.layers)
            features = tap.features()[0] if tap is not None else None
            mx.eval([c.state for c in pending.store.layers], features)
            pending.store.add(chunk, features)
            self.prefill_tokens += len(chunk)
        pending.prefill_s += time.perf_counter() - start
        if not pending.left:
            self._pending.remove(pending)
            self._join(pending)

    def _join(self, pending: _Pending) -> None:
        """Make the prefilled request a row of the batch."""
        setup, request = self.setup, pending.request
        drafter = self._idle.pop() if self._idle else setup.drafter.fork()
        pacer = copy.deepcopy(setup.pacer)
        if pacer.max_gamma > 0:
            (check_compactable if drafter.makes_trees else check_rewindable)(pending.store.layers)
        drafter.prefill(request.prompt, pending.store.features if self._batch.tap is not None else None)
        stops = tuple(request.stop)
        stopper = StopStrings(setup.tokenizer, stops) if stops else None
        stop_tokens = set(setup.tokenizer.eos_token_ids)
        seed = request.seed if request.seed is not None else random_seed()
        row = Row(
            list(request.prompt),
            drafter,
            pacer,
            request.sampling,
            make_verifier(request.sampling, request.typical),
            stop_tokens,
            stopper,
            request.max_tokens,
            pending.store,
            seed,
        )
        stats = GenerationStats(drafter=drafter.name, num_draft_tokens=pacer.max_gamma,
                                prompt_tokens=len(request.prompt),
                                prompt_s=pending.prefill_s, cached_tokens=pending.store.reused)
        row.request, row.output = (
            request,
            Output(setup.tokenizer, stats, stop_tokens, stops, stopper, pacer.adaptive),
        )
        self._batch.add(row)

    def _drop_ending(self) -> None:
        """End the rows whose request was cancelled or passed its deadline (after their last round)."""
        for row in list(self._batch.rows):
            if row.request.ending():
                stats = row.output.snapshot()
                stats.generation_s = stats.draft_s + stats.verify_s if stats.rounds else 0.0
                self._leave(row, stats, row.request.why)

    def _round(self) -> None:
        try:
            results = self._batch.round()
        except Exception as e:  # a bug must not kill the thread: fail every row, start afresh
            for row in list(self._batch.rows):
                row.request.post(Failed(f"internal error: {type(e).__name__}: {e}", 500))
                self._running.remove(row.request)
            self._batch = Batch(self.setup.model, self._batch.tap)
            return
        now = time.perf_counter()
        self.forwards += 1
        self.tokens += sum(len(result.tokens) for result in results)
        for result in results:
            row = result.row
            events = row.output.round(result.tokens, result.kinds, result.stats, result.finish_reason, now)
            row.request.last = result.tokens[-1] if result.tokens else row.request.last
            row.request.post(
                Committed(tuple(events), result.stats, row.output.snapshot(), result.finish_reason)
            )
            if result.finish_reason:
                self._leave(row, row.output.snapshot(), None)

    def _leave(self, row: Row, stats: GenerationStats, stopped: str | None) -> None:
        if (
            row.pacer.adaptive
        ):  # what it learned carries to the next generation, as one-at-a-time's shared pacer
            self.setup.pacer = row.pacer
        self._idle = (self._idle + [row.drafter])[-self.max_batch :]
        self._batch.remove(row)
        self._running.remove(row.request)
        self._release_slot(row.request, row.store)
        self._finish(row.request, stats, stopped)

    # Both.

    def _take_slot(self, request: Request) -> PromptCache:
        """The cache ``request`` generates into: its own, a prefix-cache slot, or a fresh one."""
        cache = self.setup.prefix_cache
        if request.cache is not None:
            return request.cache
        if cache is None or not request.reuse:
            return PromptCache(self.setup.model)
        return cache.take(request.prompt)

    def _release_slot(self, request: Request, slot: PromptCache) -> None:
        if request.cache is None and request.reuse and self.setup.prefix_cache is not None:
            self.setup.prefix_cache.release(slot)

    def _finish(self, request: Request, stats: GenerationStats, stopped: str | None) -> None:
        """Post the request's ``Done`` (``stopped``: ``"cancelled"``, ``"timeout"`` or ``None``, it ran
        out)."""
        if stopped is None:
            reason = stats.finish_reason or "length"
            eos = set(self.setup.tokenizer.eos_token_ids)
            done = Done(stats, reason, stop_string=reason == "stop" and request.last not in eos)
        else:
            done = Done(
                stats, "cancelled" if stopped == "cancelled" else "length", timed_out=stopped == "timeout"
            )
        request.post(done)
        if self._on_done is not None:
            self._on_done(request, done)


def _say_measuring(what: str) -> None:
    print(f"mlxspec: measuring {what} (once on this machine; cached)", file=sys.stderr, flush=True)


def batch_generate(model: nn.Module, tokenizer, prompts: list[str | list[int]], *,
                   drafter: Drafter | str = "none", num_draft_tokens: int | str = 4, max_tokens: int = 256,
                   sampling: SamplingParams | None = None, seed: int | None = None,
                   stop: list[str] | tuple[str, ...] | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                   prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> list[GenerationResult]:
    """Generate for many prompts at once, offline: the runner's continuous batching in the calling thread.

    Each prompt is a generation of its own, distributed exactly as ``generate`` would make it (greedy answers
    equal ``generate``'s up to float32 rounding of batched matmuls); up to ``max_batch`` decode together, each
    with its own fork of ``drafter`` and its own pacer (mlx-lm's ``batch_generate``, with speculation inside
    the batch). A drafter that cannot fork (``Drafter.fork``) runs the prompts one at a time.

    Args:
        model, tokenizer: The target and its ``TokenizerWrapper``.
        prompts: Texts (encoded as-is) or token ids, one per generation.
        drafter: A ``Drafter`` or spec string (``make_drafter``). Default: ``"none"``.
        num_draft_tokens: γ, ``"auto"`` or ``"scheduled"`` (``pacing.make_pacer``). Default: ``4``.
        max_tokens: Most tokens per generation. Default: ``256``.
        sampling: Temperature and filters, for every prompt. Default: greedy.
        seed: Prompt i's random draws are seeded with ``seed + i``; ``None``: unseeded. Default: ``None``.
        stop: Stop strings, for every prompt. Default: none.
        max_batch: Most generations decoding together. Default: ``DEFAULT_MAX_BATCH``.
        prefill_chunk: Prompt tokens prefilled between two rounds. Default: ``DEFAULT_PREFILL_CHUNK``.

    Returns:
        list[GenerationResult]: One per prompt, in order.

    Raises:
        TypeError: an argument of the wrong kind (``prompts`` not a list, a prompt neither text nor token ids:
            naming its index).
        ValueError: a bad drafter spec or γ, ``max_tokens``, ``max_batch`` or ``prefill_chunk`` below 1, a
            prompt that is empty, does not fit the context or holds a token id outside the vocabulary (naming
            the prompt's index).
    """
    from ..drafters import make_drafter

    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (texts or lists of token ids), got "
                        f"{type(prompts).__name__}")
    check_types(drafter, num_draft_tokens, max_tokens, sampling, seed=seed)
    for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
        if not is_int(value):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    stops = check_stops(stop)
    encoded = []
    for i, prompt in enumerate(prompts):
        check_prompt(prompt, f"prompt {i}")
        try:
            encoded.append(encode_prompt(tokenizer, prompt))
        except ValueError as e:  # empty
            raise ValueError(f"prompt {i}: {e}") from None
    drafter = make_drafter(drafter, model, tokenizer) if isinstance(drafter, str) else drafter
    runner = Runner(max_batch=max_batch, queue_size=max(len(prompts), 1), prefill_chunk=prefill_chunk)
    runner.use(Setup(model, tokenizer, drafter, num_draft_tokens))
    sampling = sampling or SamplingParams()
    records: list[list] = [[] for _ in prompts]
    for i, ids in enumerate(encoded):
        runner.submit(
            Request(
                ids,
                max_tokens,
                sampling,
                None if seed is None else seed + i,
                stops,
                records[i].append,
                reuse=False,
            )
        )
    runner.drain()
    results = []
    for i, got in enumerate(records):
        if isinstance(got[-1], Failed):
            raise ValueError(f"prompt {i}: {got[-1].message}")
        events = [event for record in got if isinstance(record, Committed) for event in record.events]
        results.append(
            GenerationResult("".join(e.text for e in events), [e.token for e in events], got[-1].stats)
        )
    return results
