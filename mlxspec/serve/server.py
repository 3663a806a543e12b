"""Load the model on the worker thread and run uvicorn until SIGINT/SIGTERM (then exit 0)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Callable

import uvicorn

from .app import create_app
from .metrics import Metrics
from .jobs import Defaults, ServerState
from .worker import Worker

#: uvicorn: most bytes of an incomplete HTTP event (headers) before the connection is refused.
MAX_HEADER_BYTES = 64 * 1024
#: uvicorn: seconds an idle keep-alive connection stays open.
KEEP_ALIVE_S = 5
#: uvicorn: seconds open requests get to finish after SIGINT/SIGTERM (running ones are cancelled first).
GRACEFUL_S = 5


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` for uvicorn to serve on, bound before the model loads.

    Raises:
        ValueError: the address is taken or cannot be bound, naming it and the fix (uvicorn would log
            its own error after the "listening" line and exit 3).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(
            f"could not listen on {_shown(host)}:{port} ({e.strerror or e}); stop what holds it or "
            "choose another --port or --host"
        ) from None
    sock.set_inheritable(True)
    return sock


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Server(uvicorn.Server):
    """uvicorn's server that cancels every generation as soon as it is told to stop."""

    worker: Worker

    def handle_exit(self, sig, frame):
        self.worker.cancel_all()
        super().handle_exit(sig, frame)


def serve(args: argparse.Namespace, defaults: Defaults, load: Callable[[], tuple]) -> int:
    """Load with ``load`` on the worker thread, then serve until SIGINT/SIGTERM; returns 0.

    Raises:
        ValueError, FileNotFoundError: the address cannot be bound, or the model or drafter cannot be
            loaded (one line, exit 2); a sharded job lost a rank (``_check_alive``).
    """
    sock = bind(args.host, args.port)
    metrics = None
    worker = Worker(
        load,
        args.queue_size,
        (args.prefix_cache_slots, int(args.prefix_cache_gb * 2**30)),
        on_done=lambda job, done: metrics.finished(job, done),
        max_batch=args.max_batch,
    )
    metrics = Metrics(
        lambda: worker.queued,
        lambda: worker.busy,
        lambda: worker.rows,
        lambda: worker.runner.tokens_per_forward,
    )
    try:
        served = worker.start()
    except (
        KeyboardInterrupt
    ):  # the worker thread is mid-load in MLX: a normal exit would tear MLX down under it
        print(
            "\nmlxspec: interrupted (Ctrl+C) while loading the model; nothing was served",
            file=sys.stderr,
            flush=True,
        )
        os._exit(130)  # (std::terminate, exit -6); nothing is open yet that needs closing
    state = ServerState(worker, served, defaults, args.request_timeout, metrics, args.api_key)
    config = uvicorn.Config(
        create_app(state, body_timeout_s=args.body_timeout),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_S,
    )
    server = _Server(config)
    server.worker = worker
    worker.on_failure = lambda e: setattr(server, "should_exit", True)  # a sharded job lost a rank
    _check_alive(worker)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it caught after shutting down:
        signal.signal(sig, lambda *_: None)  # land it here, so a requested stop exits 0
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    print(
        f"mlxspec serve: {served.model_id} with the {served.drafter} drafter on "
        f"http://{_shown(args.host)}:{port}/v1 (OpenAI: /v1/chat/completions, /v1/completions, "
        "/v1/responses; Anthropic: /v1/messages; API docs: /docs); Ctrl+C stops",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])
    worker.close()
    _check_alive(worker)
    if not server.started:  # the port could not be bound (uvicorn said why)
        raise ValueError(f"could not listen on {args.host}:{args.port}; choose another --port or --host")
    print("mlxspec serve: stopped", file=sys.stderr, flush=True)
    return 0


def follow(args: argparse.Namespace, load: Callable[[], tuple]) -> int:
    """A rank other than 0 of a sharded server (``serve --shard``): load with ``load``, then run every request
    rank 0 shares (``worker.Worker``), until rank 0's server stops; returns 0.

    Ctrl+C is left to rank 0 (the terminal sends it to every rank): it stops serving and tells this rank.

    Raises:
        ValueError, FileNotFoundError: the model or drafter cannot be loaded; the job lost a rank.
    """
    worker = Worker(
        load,
        args.queue_size,
        (args.prefix_cache_slots, int(args.prefix_cache_gb * 2**30)),
        max_batch=args.max_batch,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker.start()
    worker.wait()
    _check_alive(worker)
    return 0


def _check_alive(worker: Worker) -> None:
    """Raise if a sharded server's worker stopped on a failed collective (a rank of the job died).

    Raises:
        ValueError: naming the failure; the server stops (status 2).
    """
    if worker.error is not None:
        detail = " ".join(str(worker.error).split())
        raise ValueError(f"the sharded job lost a rank ({detail}); the server stopped")
