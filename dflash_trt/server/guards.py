"""Who may call the server: the API key, JSON bodies only, and the Host header of a keyless loopback server.

- The key: `Authorization: <scheme> <key>` with the scheme `Bearer` in any case (RFC 7235), the key compared byte
  for byte in constant time. A key must be printable ASCII without spaces, what an HTTP header carries intact; an
  empty or unusable key is refused when the server starts, never turned into "no key".
- POST bodies must say `Content-Type: application/json`. A web page may send any site a "simple" cross-site POST
  (text/plain, a form, or a body with no type) without the browser asking the site first; requiring JSON makes
  the browser ask (CORS preflight), and this server answers no preflight, so pages cannot drive it.
- A server without a key that listens on loopback answers only requests whose Host names loopback (localhost,
  127.0.0.0/8, [::1]) or a name the operator added (`--allowed_hosts`): a page on attacker.example whose name is
  re-pointed at 127.0.0.1 (DNS rebinding) still sends `Host: attacker.example`, so it cannot read answers. Jupyter
  checks the same way. A server with a key, or one listening beyond loopback (which anyone on the network reaches
  by whatever name they use), takes any Host.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from dflash_trt.errors import DFlashTrtError
from dflash_trt.server.errors import FORBIDDEN, UNAUTHORIZED, UNSUPPORTED_MEDIA_TYPE, error
from dflash_trt.server.protocol import ErrorResponse

JSON = "application/json"
LOOPBACK_NAMES = frozenset({"localhost"})

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[..., Awaitable[Any]], Callable[..., Awaitable[None]]], Awaitable[None]]


def check_api_key(key: str, source: str) -> bytes:
    """The key as the bytes a client's header carries; DFlashTrtError for a key no client could send."""
    if not key:
        raise DFlashTrtError(f"{source} is empty: give a key, or leave it out to serve without one")
    if not all("!" <= c <= "~" for c in key):
        raise DFlashTrtError(
            f"{source} must be printable ASCII without spaces (what an HTTP Authorization header carries intact)"
        )
    return key.encode("ascii")


def key_refusal(expected: bytes | None, authorization: str | None) -> ErrorResponse | None:
    if expected is None:
        return None
    scheme, _, credentials = (authorization or "").partition(" ")
    given = credentials.strip(" ").encode("latin-1")  # how the server decoded the header's bytes
    if hmac.compare_digest(given, expected) and scheme.lower() == "bearer":
        return None
    return error("a valid API key is required (Authorization: Bearer KEY)", status=UNAUTHORIZED)


def content_type_refusal(content_type: str | None) -> ErrorResponse | None:
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type == JSON:
        return None
    given = f"got {content_type!r}" if content_type else "none was given"
    return error(f"the body must be sent as Content-Type: {JSON} ({given})", status=UNSUPPORTED_MEDIA_TYPE)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP literal, IPv6 with or without brackets) names this machine's loopback."""
    name = host.strip("[]").lower().removesuffix(".")
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


class HostCheck:
    """ASGI middleware: 403 for a request whose Host is neither loopback nor one of `allowed`."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]):
        self.app = app
        self.allowed = frozenset(name.lower() for name in allowed)

    def permits(self, header: bytes) -> bool:
        name = host_name(header.decode("latin-1").strip())
        return is_loopback(name) or name.lower() in self.allowed

    async def __call__(self, scope: Scope, receive: Callable[..., Awaitable[Any]], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope["headers"] if name == b"host"), None)
        if header is None or self.permits(header):  # no Host at all: HTTP/1.0, which no browser sends
            await self.app(scope, receive, send)
            return
        refused = error(
            f"Host {header.decode('latin-1')!r} is refused: a server without an API key on loopback answers only "
            "requests for localhost, 127.0.0.1 and [::1] (start serve with --allowed_hosts NAME to add a name, or "
            "with --api_key)",
            status=FORBIDDEN,
        )
        await JSONResponse(refused.model_dump(), status_code=FORBIDDEN)(scope, receive, send)
