"""What every API's routes share: the server's state, request → job, waiting on the worker, stats."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..core.metrics import GenerationStats
from ..core.sampling import SamplingParams
from .errors import ApiError
from .metrics import Metrics
from .schemas.base import Speculative
from .tools import ToolFormat, tool_format
from .worker import Delta, Done, Failed, Job, QueueFull, Served, Worker

#: Seconds a client is asked to wait before retrying when the queue is full.
RETRY_AFTER_S = 2


@dataclass
class Defaults:
    """The command line's generation settings, used where a request names none."""

    sampling: SamplingParams
    max_tokens: int
    seed: int | None
    stop: tuple[str, ...]


@dataclass
class ServerState:
    """What the routes need (``app.state.server``).

    Attributes:
        worker: The model's thread.
        served: What it serves.
        defaults: Generation settings from the command line.
        timeout_s: Most seconds a request may take, queueing included; then it ends as if ``max_tokens``
            were reached.
        metrics: The Prometheus metrics.
        api_key: The key every ``/v1`` request must give, or ``None``.
    """

    worker: Worker
    served: Served
    defaults: Defaults
    timeout_s: float
    metrics: Metrics
    api_key: str | None = None

    @functools.cached_property
    def tool_format(self) -> ToolFormat | None:
        """The served model's tool-call format (``tools.tool_format``), found once."""
        return tool_format(self.served.tokenizer)


def state(request: Request) -> ServerState:
    return request.app.state.server


def accept(request: Request, body):
    """Refuse what a validated ``body`` asks but cannot be honoured, and another model's name.

    Raises:
        ApiError: 400 for an unsupported field, 404 for another model's name.
    """
    problem = body.unsupported()
    if problem is not None:
        raise ApiError(400, problem[1], param=problem[0], code="unsupported_parameter")
    served = state(request).served
    if body.model not in (served.model_id, "default"):
        raise ApiError(404, f"the model {body.model!r} is not served here; use {served.model_id!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")


def sampling(server: ServerState, temperature, top_p, top_k, min_p=None) -> SamplingParams:
    """The request's sampling, the command line's where it names none.

    Raises:
        ApiError: 400 for values ``SamplingParams`` refuses.
    """
    d = server.defaults.sampling
    try:
        return SamplingParams(
            temp=d.temp if temperature is None else temperature,
            top_p=d.top_p if top_p is None else top_p,
            top_k=d.top_k if top_k is None else top_k,
            min_p=d.min_p if min_p is None else min_p,
            repetition_penalty=d.repetition_penalty,
        )
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_value") from None


def check_context(served: Served, prompt: list[int]) -> None:
    """Refuse a prompt that leaves no room in the model's context (400, ``context_length_exceeded``)."""
    if served.context and len(prompt) >= served.context:
        raise ApiError(
            400,
            f"the prompt has {len(prompt)} tokens but the model's context is {served.context}; "
            "shorten the conversation",
            param="messages",
            code="context_length_exceeded",
        )


def submit(
    request: Request,
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int | None,
    seed: int | None,
    stop: list[str],
) -> Job:
    """Queue a job for the worker.

    Raises:
        ApiError: 400 for a prompt over the context, 503 (with ``Retry-After``) when the queue is full.
    """
    server = state(request)
    check_context(server.served, prompt)
    job = Job(
        prompt,
        max_tokens or server.defaults.max_tokens,
        params,
        server.defaults.seed if seed is None else seed,
        stop or list(server.defaults.stop),
        time.monotonic() + server.timeout_s,
        asyncio.get_running_loop(),
    )
    try:
        server.worker.submit(job)
    except QueueFull:
        server.metrics.rejected.inc()
        raise ApiError(
            503,
            f"the server is busy ({server.worker.queued} queued); retry in {RETRY_AFTER_S} s",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    return job


def watch(request: Request, job: Job) -> asyncio.Task:
    """A task that cancels ``job`` when the client disconnects (the worker stops after its current round)."""

    async def run():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancelled.set()

    return asyncio.create_task(run())


async def first_event(job: Job, watcher: asyncio.Task):
    """Wait for the job's first event (so a refusal still gets its status code).

    Raises:
        ApiError: the worker's refusal (400) or failure (500).
    """
    event = await job.events.get()
    if isinstance(event, Failed):
        watcher.cancel()
        raise ApiError(event.status, event.message)
    return event


async def events(job: Job, first):
    """``first``, then every later event up to and including the ``Done``."""
    event = first
    while True:
        if isinstance(event, Failed):
            raise ApiError(event.status, event.message)
        yield event
        if isinstance(event, Done):
            return
        event = await job.events.get()


async def collect(job: Job, watcher: asyncio.Task, first) -> tuple[str, Done]:
    """The whole answer's text and its ``Done`` (non-streaming requests)."""
    texts, done = [], None
    try:
        async for event in events(job, first):
            if isinstance(event, Delta):
                texts.append(event.text)
            else:
                done = event
    finally:
        watcher.cancel()
    return "".join(texts), done


class EventStream(StreamingResponse):
    """Server-sent events whose job is cancelled when the client goes away or the stream ends."""

    def __init__(self, content, job: Job, watcher: asyncio.Task):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.job, self.watcher = job, watcher

    async def __call__(self, scope, receive, send):
        try:
            await self.stream_response(send)
        except OSError:  # the client went away mid-stream
            pass
        finally:
            self.job.cancelled.set()
            self.watcher.cancel()
            await self.body_iterator.aclose()


def speculative(stats: GenerationStats) -> Speculative:
    """The per-response speculation stats (the ``speculative`` extension object); no γ when nothing was
    drafted."""
    rounds = sum(stats.gamma_rounds) if stats.drafted else 0
    return Speculative(
        drafter=stats.drafter,
        gamma=stats.num_draft_tokens if stats.drafted else None,
        gamma_mean=round(sum(g * n for g, n in enumerate(stats.gamma_rounds)) / rounds, 3)
        if rounds
        else None,
        rounds=stats.rounds,
        drafted=stats.drafted,
        accepted=stats.accepted,
        alpha=round(stats.alpha, 4),
        tau=round(stats.tau, 3),
        per_position=[round(a, 4) for a in stats.acceptance_per_position],
        prefill_s=round(stats.prompt_s, 4),
        decode_tokens_per_s=round(stats.generation_tps, 2),
    )


def new_id(prefix: str) -> str:
    """A response id: ``prefix`` and 24 random hex digits."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"
