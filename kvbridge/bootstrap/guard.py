"""``Guard``: who may do what, and how big a body may be, decided before routing.

    request                                   needs                                    otherwise
    POST / PUT / PATCH / DELETE (any path)    the write or admin token, when the       401
                                              write token is configured
    GET / HEAD of /v1/... and /diagnostics    the read, write or admin token, when     401
                                              *any* token is configured
    /healthz, /metrics, /docs, /openapi.json  nothing (probes, scrapers, humans)

Reads name what a peer needs to reach a rank (control endpoints, transport session ids,
buffer addresses): a daemon that guards its writes guards its reads too, so with only a
write token configured an anonymous read is refused, and the ranks (which hold the write
token) read as before. Only a daemon with no token at all (a laptop, a test) answers
anonymous reads; ``serve`` warns when such a daemon listens beyond loopback.

A prefix rule, not a per-route list: a read route added under ``/v1/`` (such as
``GET /v1/ranks/{rank_id}``) is covered the day it is added. The token is compared in
constant time once; what it grants is left in ``scope["state"]["kvbridge_access"]``
(``access_of(request)``) for the per-rank checks the registry makes: a rank's
heartbeat, deregistration and replacement need its lease secret (header
``X-KVBridge-Lease``) or the admin token.

Bodies over ``max_body_bytes`` are refused with 413 whether Content-Length says so or
a chunked body grows past it, and non-JSON media types with 415, before the app
reads anything. Request counts and latencies are recorded here, after the answer.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvbridge.bootstrap.metrics import Metrics
from kvbridge.bootstrap.responses import error_response

__all__ = ["Guard", "access_of", "LEASE_HEADER", "READ_PREFIXES", "ADMIN", "WRITE", "READ"]

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
READ_PREFIXES = ("/v1/", "/diagnostics")
LEASE_HEADER = "X-KVBridge-Lease"
ADMIN, WRITE, READ = "admin", "write", "read"
_GRANTS = {ADMIN: frozenset({ADMIN, WRITE, READ}), WRITE: frozenset({WRITE, READ}), READ: frozenset({READ})}


def access_of(request: Request) -> frozenset[str]:
    """What the request's bearer token granted (``admin`` / ``write`` / ``read``)."""
    return request.scope.get("state", {}).get("kvbridge_access", frozenset())


class Guard:
    """ASGI middleware: tokens and body size before routing; metrics after."""

    def __init__(self, app: ASGIApp, *, tokens: Mapping[str, str | None], max_body_bytes: int) -> None:
        self.app = app
        self.tokens = {level: t.encode() for level, t in tokens.items() if t}
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        method: str = scope["method"]
        status = {"code": 500}
        metrics: Metrics | None = getattr(scope["app"].state, "metrics", None)

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            granted = self._granted(scope)
            scope.setdefault("state", {})["kvbridge_access"] = granted
            refusal = self._authorize(scope, method, granted)
            if refusal is None and method in WRITE_METHODS:
                refusal, receive = await self._bounded_body(scope, receive)
            if refusal is not None:
                if metrics is not None:
                    metrics.inc("kvbridge_bootstrap_rejected_requests_total", reason=refusal[1])
                await refusal[0](scope, receive, send_counted)
                return
            await self.app(scope, receive, send_counted)
        finally:
            if metrics is not None:
                route = getattr(scope.get("route"), "path", "unrouted")  # templates only: bounded labels
                metrics.inc("kvbridge_bootstrap_http_requests_total", route=route, method=method, code=str(status["code"]))
                metrics.observe("kvbridge_bootstrap_request_duration_seconds", time.perf_counter() - t0, route=route, method=method)

    def _granted(self, scope: Scope) -> frozenset[str]:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return frozenset()
        given = given.strip()
        # every comparison runs (constant time each): no timing hint of which token matched
        matched = [level for level, token in self.tokens.items() if hmac.compare_digest(given, token)]
        return frozenset().union(*(_GRANTS[level] for level in matched))

    def _authorize(self, scope: Scope, method: str, granted: frozenset[str]) -> tuple[Response, str] | None:
        if method in WRITE_METHODS:
            need, configured = WRITE, WRITE in self.tokens
        elif scope["path"].startswith(READ_PREFIXES):
            need, configured = READ, bool(self.tokens)
        else:
            return None
        if not configured or need in granted:
            return None
        header = dict(scope["headers"]).get(b"authorization", b"")
        what = "every write" if need == WRITE else "reads of /v1 and /diagnostics"
        if not header:
            response = error_response(401, "missing_token", f"this daemon needs 'Authorization: Bearer <token>' on {what}",
                                      headers={"WWW-Authenticate": 'Bearer realm="kvbridge"'})
        else:
            response = error_response(401, "wrong_token", f"bearer token refused for {what}",
                                      headers={"WWW-Authenticate": 'Bearer realm="kvbridge"'})
        return response, "unauthorized"

    async def _bounded_body(self, scope: Scope, receive: Receive) -> tuple[tuple[Response, str] | None, Receive]:
        """Read the whole body up to the limit, then replay it to the app."""
        limit = self.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return (error_response(400, "bad_content_length", f"Content-Length {length[:32]!r} is not a number"), "bad_length"), receive
            if int(length) > limit:
                return (error_response(413, "body_too_large", f"body of {int(length)} bytes exceeds the limit of {limit}"), "too_large"), receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return (error_response(413, "body_too_large", f"body exceeds the limit of {limit} bytes"), "too_large"), receive
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        media = dict(scope["headers"]).get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if body and media != b"application/json" and not media.endswith(b"+json"):
            return (error_response(415, "unsupported_media_type", f"body must be application/json, not {media[:64].decode('latin-1')}"), "media_type"), receive
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return None, replay
