"""The Origin allow-list: which web pages may open a realtime session or send a POST.

A browser names the page behind every WebSocket handshake and every cross-site POST in the
``Origin`` header, and it lets any page open a WebSocket to any server, or send a ``text/plain``
or form POST, without asking the server first (no CORS preflight). Without a check, a page a user
merely visits could talk to a keyless server on their machine or network. So by default only
same-origin requests pass: the Origin's host and port must be the request's ``Host``. More pages
are allowed with ``--allowed-origin ORIGIN`` (``*``: any). Requests without an ``Origin``
header (SDKs, curl, servers) are not browsers' and pass untouched; so do safe HTTP methods
(GET, HEAD, OPTIONS), whose responses a foreign page cannot read (no CORS headers are served).

Refused: a WebSocket handshake gets HTTP 403 before the upgrade (the ASGI close before accept);
an HTTP request gets 403 with the OpenAI error body, code ``origin_not_allowed``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .http.errors import APIError

log = logging.getLogger(__name__)

#: Methods a foreign page may use: their responses are not readable cross-origin.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ANY_ORIGIN = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
#: The close code sent before accepting a refused handshake (servers answer it with HTTP 403).
CLOSE_POLICY = 1008


def normalize_origin(origin: str) -> str | None:
    """``scheme://host[:port]`` in lower case, the scheme's default port left out; None when
    ``origin`` is not an origin (``null``, a path, garbage)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in _DEFAULT_PORTS or not host or parts.path not in ("", "/"):
        return None
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}" if port is None or port == _DEFAULT_PORTS[scheme] else f"{scheme}://{host}:{port}"


def _authority(origin: str) -> str:
    """``host[:port]`` of a normalized origin."""
    return origin.split("://", 1)[1]


def _host_header(host: str) -> str:
    host = host.strip().lower()
    for default in (":80", ":443"):
        if host.endswith(default):
            return host[: -len(default)]
    return host


class OriginPolicy:
    """Same-origin, plus the origins listed (``*`` in the list: every origin)."""

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        allowed = list(allowed)
        self.any = ANY_ORIGIN in allowed
        self.allowed: set[str] = set()
        for origin in allowed:
            if origin == ANY_ORIGIN:
                continue
            normal = normalize_origin(origin)
            if normal is None:
                raise ValueError(f"not an origin (scheme://host[:port]): {origin!r}")
            self.allowed.add(normal)

    def permits(self, origin: str, host: str | None) -> bool:
        if self.any:
            return True
        normal = normalize_origin(origin)
        if normal is None:
            return False
        if normal in self.allowed:
            return True
        return host is not None and _authority(normal) == _host_header(host)


class OriginGuard:
    """ASGI middleware applying an :class:`OriginPolicy` to WebSockets and unsafe HTTP methods."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket" or (kind == "http" and scope["method"] not in SAFE_METHODS):
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if origin is not None and not self.policy.permits(origin, headers.get("host")):
                log.info("refused %s %s from origin %r", kind, scope["path"], origin[:200])
                if kind == "websocket":
                    await send({"type": "websocket.close", "code": CLOSE_POLICY, "reason": ""})
                else:
                    response = APIError(
                        403,
                        "Requests from this web origin are not allowed: the server accepts browser "
                        "requests from its own origin and from those given with --allowed-origin.",
                        code="origin_not_allowed",
                    ).response()
                    await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
