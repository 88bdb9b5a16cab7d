"""Every error the server sends, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

A refused request is a 4xx naming the field at fault. Unknown routes (404) and wrong methods (405)
get the same shape instead of the web framework's `{"detail": ...}`. A fault in the server itself is a
500 that says so without internals (the traceback goes to the server log), sent on the same
connection, which stays open for the client's next request. A streamed response that already began
cannot change its status: it ends with an error event instead (see `server.py`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# uvicorn configures this logger: server faults show up with its formatting and level.
log = logging.getLogger("uvicorn.error")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """A request the server refuses or could not serve: HTTP status, message, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = INVALID_REQUEST, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def server_fault() -> ApiError:
    return ApiError(500, "the server failed while handling this request; the failure is in its log",
                    kind=SERVER_ERROR)


def error_response(err: ApiError) -> Response:
    # ASCII-escaped: a message quoting client text must render even if that text is not valid
    # Unicode (a lone surrogate would make a UTF-8 encoder raise, turning a 400 into a 500).
    content = json.dumps(err.body(), ensure_ascii=True, separators=(",", ":"))
    return Response(content, status_code=err.status, headers=err.headers, media_type="application/json")


def http_error(request: HttpRequest, exc: StarletteHTTPException, routes: str) -> ApiError:
    """The framework's own HTTP errors (no such route, wrong method) as API errors."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return ApiError(404, f"no such route: {where}; this server serves {routes}", code="unknown_url")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return ApiError(405, f"method {request.method} is not allowed on {request.url.path}; use "
                             f"{allowed or 'another method'}", code="method_not_allowed",
                        headers={"Allow": allowed} if allowed else None)
    kind = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    return ApiError(exc.status_code, f"{where}: {exc.detail}", kind=kind)


def install_error_handlers(app: FastAPI, routes: str) -> None:
    """Make every error `app` sends an OpenAI error; `routes` lists the served routes for a 404."""

    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, err: ApiError) -> Response:
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(request: HttpRequest, exc: StarletteHTTPException) -> Response:
        return error_response(http_error(request, exc, routes))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HttpRequest, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return error_response(ApiError(400, f"`{param}`: {first.get('msg', 'invalid')}" if param
                                       else str(first.get("msg", "invalid request")), param))

    app.add_middleware(FaultMiddleware)


class FaultMiddleware:
    """Answers an unexpected exception with a 500 in the API's shape, on the same connection.

    It sits inside the framework's outermost error middleware, which would also answer with a 500
    but then re-raise, and the HTTP server closes the connection on that: a client's keep-alive
    connection would be reset by one failed request. Once a response has started, nothing can be
    said any more; the exception goes on and the connection is closed, which the client sees as a
    truncated response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            log.exception("server fault in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await error_response(server_fault())(scope, receive, send)
