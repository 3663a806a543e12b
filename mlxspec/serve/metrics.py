"""``GET /metrics``: Prometheus text through ``prometheus-client``, one registry per server.

Acceptance is exported as counters (drafted and accepted tokens): α over any window is
``rate(mlxspec_accepted_tokens_total[5m]) / rate(mlxspec_drafted_tokens_total[5m])``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The server's metrics; ``finished`` is called on the worker thread (prometheus-client is
    thread-safe)."""

    def __init__(self, queue_length, busy, rows=lambda: 0, tokens_per_forward=lambda: 0.0):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mlxspec_requests", "HTTP requests answered", ["path", "status"], registry=r)
        self.rejected = Counter("mlxspec_rejected", "Requests refused because the queue was full", registry=r)
        self.prompt_tokens = Counter(
            "mlxspec_prompt_tokens", "Prompt tokens of finished generations", registry=r
        )
        self.cached_tokens = Counter(
            "mlxspec_cached_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.generated_tokens = Counter("mlxspec_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("mlxspec_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("mlxspec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.rounds = Counter("mlxspec_rounds", "Verify rounds", registry=r)
        self.cancelled = Counter(
            "mlxspec_cancelled", "Generations stopped early (client gone or timeout)", ["why"], registry=r
        )
        self.ttft = Histogram(
            "mlxspec_time_to_first_token_seconds",
            "From request to its first text, queueing included",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "mlxspec_generation_seconds",
            "From request to its last token, queueing included",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        Gauge("mlxspec_queue_length", "Requests waiting for the model", registry=r).set_function(queue_length)
        Gauge("mlxspec_busy", "1 while a request runs", registry=r).set_function(lambda: float(busy()))
        Gauge(
            "mlxspec_batch_rows", "Requests running together (prefilling or decoding)", registry=r
        ).set_function(lambda: float(rows()))
        Gauge(
            "mlxspec_tokens_per_forward",
            "Tokens committed per target forward of a round, since the start (rows × τ)",
            registry=r,
        ).set_function(lambda: float(tokens_per_forward()))

    def finished(self, job, done) -> None:
        """Count one finished job (``worker.Job``, ``worker.Done``)."""
        s = done.stats
        self.prompt_tokens.inc(s.prompt_tokens)
        self.cached_tokens.inc(s.cached_tokens)
        self.generated_tokens.inc(s.generation_tokens)
        self.drafted.inc(s.drafted)
        self.accepted.inc(s.accepted)
        self.rounds.inc(s.rounds)
        if done.finish_reason == "cancelled" or done.timed_out:
            self.cancelled.labels("timeout" if done.timed_out else "client").inc()
        if job.first_token is not None:
            self.ttft.observe(job.first_token - job.created)
        self.latency.observe(time.monotonic() - job.created)


class CountRequests:
    """ASGI middleware counting answered requests by path and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                path = scope.get("path", "")
                known = (
                    path
                    if path
                    in (
                        "/v1/chat/completions",
                        "/v1/completions",
                        "/v1/messages",
                        "/v1/messages/count_tokens",
                        "/v1/models",
                        "/v1/responses",
                        "/health",
                        "/metrics",
                    )
                    else "other"
                )
                self.metrics.requests.labels(known, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
