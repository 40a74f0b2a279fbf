"""Who may talk to the explorer: every request is checked here before any route sees it.

- With a token (required when the server listens beyond this machine), a request carries it
  as `Authorization: Bearer T`, the `actdb_token` cookie, or `?token=T` (the address the
  server prints; the answer then sets the cookie so that the page's own requests carry it).
  Tokens are compared in constant time.
- Without one (127.0.0.1 only), the Host header must name this machine, so that a web page
  elsewhere cannot reach the server through a DNS name it points at 127.0.0.1.
- POSTs must be `application/json`: a cross-site form cannot send that without the browser
  asking first (CORS), and the server never says yes.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

COOKIE = "actdb_token"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def same_token(given: str | None, token: str) -> bool:
    """Constant-time comparison: how long it takes says nothing about the token."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


class Guard:
    """ASGI middleware that answers 401, 403 or 415 itself or passes the request on."""

    def __init__(self, app: App, *, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        from_url = query.get("token", [None])[0]
        if self.token is None:
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in LOCAL_HOSTS:
                await _refuse(send, 403, f"host {host!r} is not this machine; the explorer "
                                         "without --token answers only at 127.0.0.1")
                return
        else:
            auth = headers.get("authorization", "")
            bearer = auth[7:] if auth.lower().startswith("bearer ") else None
            cookie = SimpleCookie(headers.get("cookie", ""))
            from_cookie = cookie[COOKIE].value if COOKIE in cookie else None
            if not any(same_token(t, self.token) for t in (bearer, from_cookie, from_url)):
                await _refuse(send, 401, "this explorer needs its token: open the address "
                                         "the server printed (it ends in ?token=...), or send "
                                         "Authorization: Bearer TOKEN")
                return
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                await _refuse(send, 415, "send the request body as application/json")
                return
        if self.token is not None and from_url is not None:
            send = _setting_cookie(send, self.token)
        await self.app(scope, receive, send)


def _setting_cookie(send: Send, token: str) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            headers.append((b"set-cookie", f"{COOKIE}={token}; HttpOnly; SameSite=Strict; "
                                           "Path=/".encode("latin-1")))
            message["headers"] = headers
        await send(message)

    return wrapped


async def _refuse(send: Send, status: int, text: str) -> None:
    body = json.dumps({"error": text}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
