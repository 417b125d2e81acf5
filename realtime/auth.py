"""API keys: ``Authorization: Bearer KEY`` for HTTP and WebSocket clients that can set headers,
``api-key: KEY`` for clients written for Azure OpenAI (livekit's Azure mode), and the
``openai-insecure-api-key.KEY`` subprotocol for browsers, which cannot set headers."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers

KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
REALTIME_SUBPROTOCOL = "realtime"
#: Azure OpenAI's key header.
AZURE_KEY_HEADER = "api-key"


def _matches(candidate: str | None, keys: list[str]) -> bool:
    if candidate is None:
        return False
    return any(hmac.compare_digest(candidate.encode(), k.encode()) for k in keys)


def bearer_key(headers: Headers) -> str | None:
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def subprotocols(headers: Headers) -> list[str]:
    raw = headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def subprotocol_key(headers: Headers) -> str | None:
    for proto in subprotocols(headers):
        if proto.startswith(KEY_SUBPROTOCOL_PREFIX):
            return proto[len(KEY_SUBPROTOCOL_PREFIX) :]
    return None


def authorized(headers: Headers, keys: list[str]) -> bool:
    """True when no keys are configured, or the request presents one of them."""
    if not keys:
        return True
    return (
        _matches(bearer_key(headers), keys)
        or _matches(headers.get(AZURE_KEY_HEADER), keys)
        or _matches(subprotocol_key(headers), keys)
    )


def accepted_subprotocol(headers: Headers) -> str | None:
    """The subprotocol to answer the upgrade with: ``realtime`` when the client offered it.

    A browser that offered subprotocols must get one of them back or it drops the connection.
    """
    offered = subprotocols(headers)
    if REALTIME_SUBPROTOCOL in offered:
        return REALTIME_SUBPROTOCOL
    return offered[0] if offered else None
