"""API keys. When the server has a key, every route but GET /healthz (probes carry no
credentials) needs ``Authorization: Bearer <key>``, the header the openai client sends; a
missing or wrong key gets a 401 in OpenAI's error shape with ``WWW-Authenticate: Bearer``.
Without a key the server is open (the default).

The key is read per request: from ``key_getter`` if given, else the process's key, which
set_api_key sets. That is what a Serve replica needs: its FastAPI app is built at import,
before the replica knows its arguments, and @serve.ingress serves a copy of it frozen at
decoration (so install_auth must run before that, and app.state set later is not seen); the
replica's __init__ calls set_api_key, and this module is the same one in its process.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from serving.errors import error_response

OPEN_ROUTES = {("GET", "/healthz"), ("HEAD", "/healthz")}

KeyGetter = Callable[[], str | None]


def check_api_key(key: str) -> str:
    """A usable key: non-empty printable ASCII without spaces (it travels in a header)."""
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        raise ValueError("the API key must be non-empty printable ASCII without spaces")
    return key


_process_key: str | None = None


def set_api_key(key: str | None) -> None:
    """The key ApiKeyAuth (without a key_getter) checks, for the whole process; None: none."""
    global _process_key
    _process_key = None if key is None else check_api_key(key)


def api_key() -> str | None:
    return _process_key


class ApiKeyAuth:
    """ASGI middleware checking ``Authorization: Bearer <key>`` (compared in constant time)."""

    def __init__(self, app: Any, key_getter: KeyGetter | None = None):
        self.app = app
        self.key_getter = key_getter or api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan; this server has no websockets
            return await self.app(scope, receive, send)
        key = self.key_getter()
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # a route prefix: routes match below it
            path = path[len(root) :] or "/"
        if not key or (scope["method"], path) in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            message = "missing API key: send the header 'Authorization: Bearer <key>'"
        elif hmac.compare_digest(token.strip(), key.encode("utf-8")):
            return await self.app(scope, receive, send)
        else:
            message = "invalid API key"
        response = error_response(401, message, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def install_auth(api: FastAPI, key_getter: KeyGetter | None = None) -> None:
    """Put ApiKeyAuth in front of ``api``'s routes (the outermost middleware so far)."""
    api.add_middleware(ApiKeyAuth, key_getter=key_getter)
