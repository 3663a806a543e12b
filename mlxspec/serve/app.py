"""The ASGI app: the routes of both APIs, ``/health``, ``/metrics``, errors in each API's shape,
the API key check, and the body guard (size, stalled senders)."""

from __future__ import annotations

import hmac
import sys
import traceback

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import anthropic_api, openai_api
from .errors import ApiError, BodyGuard, error_body, error_response
from .metrics import CountRequests
from .routes import ServerState

#: Largest request body accepted, bytes.
MAX_BODY_BYTES = 16 * 2**20
#: Seconds the next part of a request body may take to arrive.
BODY_TIMEOUT_S = 30.0


def create_app(server: ServerState, *, max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S):
    """The ASGI application serving ``server`` (wrap-free: pass it to uvicorn as is)."""
    app = FastAPI(title="mlxspec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.served.model_id, "drafter": server.served.drafter,
                "queued": server.worker.queued, "busy": server.worker.busy}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request.url.path, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        path = request.url.path
        message = {404: f"no such endpoint {path}; see GET /v1/models, POST /v1/chat/completions, /v1/completions, "
                        "/v1/messages",
                   405: f"{request.method} is not allowed on {path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(path, ApiError(e.status_code, message)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        traceback.print_exception(e, file=sys.stderr)
        return error_response(request.url.path, ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    return CountRequests(BodyGuard(ApiKey(app, server.api_key), max_body_bytes, body_timeout_s), server.metrics)


class ApiKey:
    """ASGI middleware: with a key set, every ``/v1`` and ``/metrics`` request must give it, as
    ``Authorization: Bearer KEY`` (OpenAI) or ``x-api-key: KEY`` (Anthropic); else 401."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope.get("path") == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        bearer = headers.get(b"authorization", b"").decode("latin-1")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode("latin-1")
        if hmac.compare_digest(given.encode(), self.key.encode()):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        response = JSONResponse(error_body(path, ApiError(401, "missing or wrong API key; send it as 'Authorization: "
                                                               "Bearer KEY' or 'x-api-key: KEY'")), status_code=401)
        await response(scope, receive, send)
