"""OpenAI-shaped errors: every failure leaves the server as `{"error": {message, type, param, code}}`.

Clients branch on the status (openai-python retries 429 and 5xx, honouring Retry-After) and on
`code` (`context_length_exceeded`), so bad input must be a 4xx with a precise body — never a
422 from FastAPI's defaults, never a 500.

Error bodies are ASCII JSON, so a message that quotes the client's input (a lone surrogate
included) always renders. An unexpected exception is a 500 on a connection that stays open:
Starlette's handler for `Exception` re-raises after answering, and uvicorn then drops the
keep-alive connection without `Connection: close`, losing the client's next request.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("compilelm")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after: int = 1, status: int = 503,
                code: str | None = None) -> OpenAIError:
    return OpenAIError(status, message, code=code, headers={"Retry-After": str(retry_after)})


def internal_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, code="internal_error")


def sse_error_event(err: OpenAIError) -> str:
    """An error after the 200 header went out: one `data: {"error": ...}` event."""
    return f"data: {json.dumps(err.body())}\n\n"


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg')}",
                           code="invalid_json")
    first, loc, more = _most_specific(errors)
    param = loc[0] if loc else None  # the top-level field
    msg = first.get("msg", "invalid value")
    if first.get("type") == "string_unicode":
        msg = "not valid Unicode text (a lone surrogate escape such as \\ud800)"
    where = f"{'.'.join(loc)}: " if loc else "request body: "
    more = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
    return bad_request(f"{where}{msg}{more}", param=param)


def _most_specific(errors: list[dict]) -> tuple[dict, list[str], int]:
    """The error to report, its location and how many other errors there are. A value that
    matches none of a union's forms (`prompt`: a string, strings, token ids or lists of them)
    gets one error per form, located under a tag per form (`constrained-str`, `list[int]`):
    report the one that got furthest (not a mismatch of the whole value's type, then the deepest)
    and leave the tag out of its location, so `"prompt": []` reads "prompt: List should have at
    least 1 item", not "prompt.constrained-str: Input should be a valid string"."""
    locs = [_body_loc(e) for e in errors]
    field = [i for i, loc in enumerate(locs) if loc[:1] == locs[0][:1]]
    depth = 0  # the length of the locations' common prefix
    while all(len(locs[i]) > depth and locs[i][depth] == locs[0][depth] for i in field):
        depth += 1
    tags = {locs[i][depth] for i in field if len(locs[i]) > depth}
    if len(field) < 2 or len(tags) < 2 or not all(isinstance(t, str) for t in tags):
        return errors[0], [str(p) for p in locs[0]], len(errors) - 1
    best = max(field, key=lambda i: (not errors[i].get("type", "").endswith("_type"), len(locs[i]), -i))
    loc = locs[best][:depth] + locs[best][depth + 1:]
    return errors[best], [str(p) for p in loc], len(errors) - len(field)


def _body_loc(error: dict) -> list:
    """The error's location in the body. A body that is one of several request models
    (`/tokenize`: the prompt or the chat form) puts the model's name first: left out (the API's
    field names are all lower case)."""
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if loc and isinstance(loc[0], str) and loc[0][:1].isupper():
        loc = loc[1:]
    return loc


def install_error_handlers(app: FastAPI) -> None:
    app.add_middleware(InternalErrorMiddleware)

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), headers=exc.headers).response()


class InternalErrorMiddleware:
    """An exception no handler took: a 500 with an OpenAI body, and the connection kept (the
    exception is logged here, not re-raised). A stream that already started gets an error event
    and `data: [DONE]` instead; any other started response can only be cut (re-raised)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent: dict = {}  # "headers" once the response started, "done" once its body ended

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                sent["headers"] = dict(message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                sent["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - answered here; the server keeps serving
            logger.exception("unhandled error serving %s %s", scope["method"], scope["path"])
            err = internal_error(f"internal server error: {type(exc).__name__}")
            if not sent:
                return await err.response()(scope, receive, send)
            if sent.get("done"):
                return
            if not sent["headers"].get(b"content-type", b"").startswith(b"text/event-stream"):
                raise
            await send({"type": "http.response.body", "more_body": False,
                        "body": (sse_error_event(err) + "data: [DONE]\n\n").encode()})
