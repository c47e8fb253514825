"""Pure-ASGI guards that run before routing: API-key auth and the request-body size limit.

Auth is decided on `scope["path"]` only (never on a URL rebuilt from the client's Host header,
CVE-2026-48746) and is deny-by-default: every path needs the key except an explicit public set.
Keys are compared as SHA-256 digests with `secrets.compare_digest` (constant time,
CVE-2025-59425).
"""

from __future__ import annotations

import hashlib
import json
import secrets


async def _send_error(send, status: int, message: str, type_: str, code: str,
                      headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    def __init__(self, app, api_keys: list[str], public_paths: frozenset[str]):
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]
        self.public_paths = public_paths

    def _authorized(self, scope) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        digest = hashlib.sha256(token.strip()).digest()
        ok = False
        for d in self.digests:  # compare with every key: the time does not depend on which matched
            ok |= secrets.compare_digest(digest, d)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public_paths or self._authorized(scope):
            return await self.app(scope, receive, send)
        await _send_error(send, 401, "Invalid or missing API key (expected `Authorization: Bearer "
                          "<key>`)", "authentication_error", "invalid_api_key",
                          [(b"www-authenticate", b"Bearer")])


class BodyLimitMiddleware:
    """Reads at most `max_bytes` of a request body; more is answered 413 before the app runs."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        await _send_error(send, 413, f"the request body is larger than {self.max_bytes} bytes",
                          "invalid_request_error", "request_too_large")
