"""The ASGI app: the routes (``routes``), errors in each API's shape, the API key check, the body guard
(size, stalled senders) and the request counter; OpenAPI at ``/openapi.json`` and ``/docs``."""

from __future__ import annotations

import hmac
import sys
import traceback

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from . import routes
from .errors import ApiError, BodyGuard, error_body, error_response, from_validation
from .jobs import ServerState
from .metrics import CountRequests

#: Largest request body accepted, bytes.
MAX_BODY_BYTES = 16 * 2**20
#: Seconds the next part of a request body may take to arrive.
BODY_TIMEOUT_S = 30.0
#: Paths open without the API key: the health check and the API's description.
OPEN_PATHS = ("/health", "/docs", "/openapi.json")


def create_app(server: ServerState, *, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S):
    """The ASGI application serving ``server`` (wrap-free: pass it to uvicorn as is)."""
    app = FastAPI(
        title="mlxspec",
        summary="OpenAI- and Anthropic-compatible server of mlxspec's speculative decoding",
        version=_version(),
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        strict_content_type=False,
    )  # a body without a Content-Type is read as JSON
    app.state.server = server
    app.include_router(routes.router)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return error_response(request.url.path, from_validation(list(e.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        path = request.url.path
        message = {
            404: f"no such endpoint {path}; see GET /v1/models, POST /v1/chat/completions, "
            "/v1/completions, /v1/messages, or /docs",
            405: f"{request.method} is not allowed on {path}",
        }.get(e.status_code, str(e.detail))
        return JSONResponse(
            error_body(path, ApiError(e.status_code, message)),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        traceback.print_exception(e, file=sys.stderr)
        return error_response(request.url.path, ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    return CountRequests(
        BodyGuard(ApiKey(app, server.api_key), max_body_bytes, body_timeout_s), server.metrics
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxspec")
    except PackageNotFoundError:
        return "unknown"


class ApiKey:
    """ASGI middleware: with a key set, every request but ``OPEN_PATHS`` must give it, as
    ``Authorization: Bearer KEY`` (OpenAI) or ``x-api-key: KEY`` (Anthropic); else 401."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        bearer = headers.get(b"authorization", b"").decode("latin-1")
        given = (
            bearer[7:]
            if bearer.lower().startswith("bearer ")
            else headers.get(b"x-api-key", b"").decode("latin-1")
        )
        if hmac.compare_digest(given.encode(), self.key.encode()):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        response = JSONResponse(
            error_body(
                path,
                ApiError(
                    401,
                    "missing or wrong API key; send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                ),
            ),
            status_code=401,
        )
        await response(scope, receive, send)
