"""Errors in each API's own shape, and the ASGI guard on request bodies (size and a stalled sender).

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic (paths under ``/v1/messages``):
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json

from starlette.responses import JSONResponse

#: HTTP status → (OpenAI error type, Anthropic error type).
ERROR_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    408: ("invalid_request_error", "timeout_error"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    """An error answered in the API's own shape.

    Args:
        status: The HTTP status.
        message: One line naming the problem and the fix.
        param: The request field at fault (OpenAI's ``param``), or ``None``.
        code: OpenAI's ``code`` (e.g. ``"context_length_exceeded"``), or ``None``.
        headers: Extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def is_anthropic(path: str) -> bool:
    """Whether ``path`` belongs to the Anthropic API (its errors take Anthropic's shape)."""
    return path.startswith("/v1/messages")


def error_body(path: str, error: ApiError) -> dict:
    """The JSON body of ``error`` for a request to ``path``."""
    openai_type, anthropic_type = ERROR_TYPES.get(
        error.status, ERROR_TYPES[500 if error.status >= 500 else 400]
    )
    if is_anthropic(path):
        return {"type": "error", "error": {"type": anthropic_type, "message": error.message}}
    return {
        "error": {"message": error.message, "type": openai_type, "param": error.param, "code": error.code}
    }


def error_response(path: str, error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(path, error), status_code=error.status, headers=error.headers)


def from_validation(errors: list[dict]) -> ApiError:
    """The first problem pydantic found in a request body, as one line naming the field.

    Args:
        errors: FastAPI's ``RequestValidationError.errors()`` (locations start with ``"body"``).

    Of a union's alternatives, the error that reached deepest names the problem (an image part among
    text parts: ``messages.0.content.0.type``, not "content should be a string").
    """
    first = max(errors, key=lambda e: sum(map(_field, e["loc"])))  # the first of the deepest
    parts = list(first["loc"])[1:] if tuple(first["loc"][:1]) == ("body",) else list(first["loc"])
    if first["type"] == "json_invalid":
        return ApiError(
            400,
            f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')}); "
            "send a JSON object",
            code="invalid_json",
        )
    loc = ".".join(str(part) for part in parts if _field(part))
    if not loc and first["type"] == "missing":
        return ApiError(400, "the body is empty; send a JSON object", code="invalid_body")
    if not loc and isinstance(first.get("input"), bytes | str):
        return ApiError(
            400,
            "the body is not JSON; send a JSON object with 'Content-Type: application/json'",
            code="invalid_body",
        )
    if first["type"] == "missing":
        return ApiError(400, f"{loc} is required", param=loc, code="missing_field")
    if not loc:
        return ApiError(400, f"the body must be a JSON object: {first['msg']}", code="invalid_body")
    return ApiError(400, f"{loc}: {first['msg']}", param=loc, code="invalid_value")


#: Names pydantic puts in an error's location for the member of a union that was tried, not a field.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field(part) -> bool:
    """Whether a location part names a field or an index (not a union member such as ``list[TextPart]``)."""
    return isinstance(part, int) or (str(part).isidentifier() and part not in _UNION_TAGS)


class BodyGuard:
    """ASGI middleware: read the whole request body before the app sees it, refusing a body over
    ``max_bytes`` (413) and one whose next part does not arrive within ``timeout_s`` (408: a client that
    sent half a request and hangs), in the API's shape.

    uvicorn's ``h11_max_incomplete_event_size`` bounds the headers and ``timeout_keep_alive`` idle
    connections; neither bounds a body, which this does.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and not length.isdigit():
            return await self._answer(path, send, ApiError(400, "the Content-Length header is not a number"))
        try:
            if length is not None and int(length) > self.max_bytes:
                raise self._too_large(int(length))
            body = await self._read(receive)
        except ApiError as e:
            return await self._answer(path, send, e)

        async def replay():  # the body once, then the client's later messages (a disconnect)
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _read(self, receive) -> dict:
        """The body as one ``http.request`` message (or the client's ``http.disconnect``)."""
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(
                    408,
                    f"the request body stopped arriving for {self.timeout_s:g} s; "
                    "send the whole body at once",
                ) from None
            if message["type"] != "http.request":
                return message
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                raise self._too_large(size)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}

    def _too_large(self, size: int) -> ApiError:
        return ApiError(
            413, f"the request body is over {self.max_bytes // 2**20} MiB ({size} bytes); send less"
        )

    @staticmethod
    async def _answer(path: str, send, error: ApiError) -> None:
        body = json.dumps(error_body(path, error)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
