"""The bootstrap daemon as a FastAPI app: ``create_app(...)``.

    POST   /v1/ranks                       register       201 | 400 401 409 413 415 422
    POST   /v1/ranks/{rank_id}/heartbeat   renew lease    200 | 401 404 (register again)
    DELETE /v1/ranks/{rank_id}             deregister     204 | 401 404
    GET    /v1/ranks/{rank_id}             one rank       200 | 404       (its buffers, for prefill's checks)
    POST   /v1/lookup                      handshake      200 | 400 401 404 409 413 415 422 503
    GET    /v1/instances[/{name}]          instances      200 | 404
    GET    /v1/diagnostics/fingerprints    per instance: fingerprint, contract, ranks
    GET    /v1/diagnostics/mismatches      recent refusals with their field diffs
    GET    /diagnostics                    the same for a person (HTML)
    GET    /healthz, /metrics, /docs, /openapi.json

State (registry, metrics) is created in the lifespan and lives on ``app.state``.
``Guard`` runs before routing: with a token configured every POST/DELETE needs
``Authorization: Bearer <token>`` (401, before the body is read), and bodies over
``max_body_bytes`` are refused with 413 whether Content-Length says so or a
chunked body grows past it. Every error body is an ``ErrorBody``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvbridge
from kvbridge.bootstrap.metrics import CONTENT_TYPE, Metrics
from kvbridge.bootstrap.page import render_diagnostics
from kvbridge.bootstrap.registry import Registry
from kvbridge.bootstrap.schemas import (
    ErrorBody,
    HeartbeatResponse,
    InstanceFingerprint,
    InstanceView,
    LookupRequest,
    LookupResponse,
    MismatchRecord,
    RankDetail,
    RegisterRequest,
    RegisterResponse,
)
from kvbridge.errors import (
    BufferSpecError,
    ConfigError,
    ContractMismatch,
    InstanceIncomplete,
    KVBridgeError,
    TopologyError,
    UnknownInstance,
)

__all__ = ["BootstrapSettings", "create_app"]

log = logging.getLogger(__name__)

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class BootstrapSettings:
    token: str | None = None
    lease_ttl_s: float = 10.0  # default lease when a rank asks for none
    max_lease_ttl_s: float = 300.0
    max_body_bytes: int = 1 << 20
    max_mismatches: int = 100
    sweep_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise ConfigError("bootstrap token is empty", field="token")
        if not 0 < self.lease_ttl_s <= self.max_lease_ttl_s:
            raise ConfigError(f"lease TTL {self.lease_ttl_s}s must be in (0, {self.max_lease_ttl_s}]", field="lease_ttl_s")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max body bytes {self.max_body_bytes} is below 1024", field="max_body_bytes")
        if self.max_mismatches < 1 or self.sweep_interval_s <= 0:
            raise ConfigError("max_mismatches and sweep_interval_s must be positive", field="max_mismatches")


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    full = ErrorBody(error=code, message=message, **extra).model_dump(mode="json")
    body = {k: v for k, v in full.items() if v is not None}  # top level only: a diff value may be null
    return JSONResponse(body, status_code=status, headers=headers)


class Guard:
    """ASGI middleware: bearer token and body size before routing; metrics after."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.token = token.encode() if token else None
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
            refusal = self._authorize(scope) if method in WRITE_METHODS else None
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

    def _authorize(self, scope: Scope) -> tuple[Response, str] | None:
        if self.token is None:
            return None
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token):
            return None
        code = "missing_token" if not header else "wrong_token"
        text = "this daemon needs 'Authorization: Bearer <token>' on every write" if not header else "bearer token refused"
        return _error(401, code, text, headers={"WWW-Authenticate": 'Bearer realm="kvbridge"'}), "unauthorized"

    async def _bounded_body(self, scope: Scope, receive: Receive) -> tuple[tuple[Response, str] | None, Receive]:
        """Read the whole body up to the limit, then replay it to the app."""
        limit = self.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return (_error(400, "bad_content_length", f"Content-Length {length[:32]!r} is not a number"), "bad_length"), receive
            if int(length) > limit:
                return (_error(413, "body_too_large", f"body of {int(length)} bytes exceeds the limit of {limit}"), "too_large"), receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return (_error(413, "body_too_large", f"body exceeds the limit of {limit} bytes"), "too_large"), receive
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        media = dict(scope["headers"]).get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if body and media != b"application/json" and not media.endswith(b"+json"):
            return (_error(415, "unsupported_media_type", f"body must be application/json, not {media[:64].decode('latin-1')}"), "media_type"), receive
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return None, replay


def _status_of(exc: KVBridgeError) -> tuple[int, str]:
    if isinstance(exc, ContractMismatch):
        return 409, "contract_mismatch"
    if isinstance(exc, TopologyError):
        return 409, "topology_mismatch"
    if isinstance(exc, InstanceIncomplete):
        return 503, "instance_incomplete"
    if isinstance(exc, UnknownInstance):
        return 404, "unknown_rank" if exc.field == "rank_id" else "unknown_instance"
    if isinstance(exc, BufferSpecError):
        return 422, "invalid_descriptor"
    return 400, "bad_request"


def _field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc[1:]] if loc and loc[0] == "body" else [str(p) for p in loc]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def _install_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVBridgeError)
    async def kvbridge_error(request: Request, exc: KVBridgeError) -> JSONResponse:
        status, code = _status_of(exc)
        diff = getattr(exc, "diff", None)
        missing = getattr(exc, "missing", None)
        headers = {"Retry-After": "1"} if status == 503 else None
        return _error(status, code, str(exc), headers=headers, field=exc.field, diff=diff or None, missing=missing)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            e = errors[0]
            where = (e.get("ctx") or {}).get("error", "")
            return _error(400, "malformed_json", f"body is not valid JSON: {where} at byte {e['loc'][-1]}", field="body")
        fields = [{"field": _field_of(tuple(e["loc"])), "message": e["msg"], "type": e["type"]} for e in errors]
        summary = "; ".join(f"{f['field']}: {f['message']}" for f in fields[:5])
        return _error(422, "invalid_request", f"invalid request body: {summary}", field=fields[0]["field"], fields=fields)


def create_app(settings: BootstrapSettings | None = None, **overrides: Any) -> FastAPI:
    """A fresh daemon; all state is made in its lifespan and kept on ``app.state``.
    ``overrides`` replace fields of ``settings`` (``create_app(token="t")``); an
    unknown name is a TypeError, not silently ignored."""
    settings = dataclasses.replace(settings or BootstrapSettings(), **overrides)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.settings = settings
        app.state.metrics = Metrics()
        app.state.registry = Registry(
            metrics=app.state.metrics,
            default_ttl_s=settings.lease_ttl_s,
            max_ttl_s=settings.max_lease_ttl_s,
            max_mismatches=settings.max_mismatches,
        )
        app.state.started = time.time()

        async def sweep() -> None:
            while True:
                await asyncio.sleep(settings.sweep_interval_s)
                app.state.registry.expire()

        task = asyncio.create_task(sweep())
        log.info("bootstrap daemon ready (token %s)", "required on writes" if settings.token else "not configured")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(
        title="kvbridge bootstrap daemon",
        version=kvbridge.__version__,
        description="Rank registry, contract fingerprints and prefill-topology lookups for PD disaggregation.",
        lifespan=lifespan,
    )
    app.add_middleware(Guard, token=settings.token, max_body_bytes=settings.max_body_bytes)
    _install_handlers(app)
    _install_routes(app)
    return app


def _registry(request: Request) -> Registry:
    return request.app.state.registry  # type: ignore[no-any-return]


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 415, 422, 503)
}
# Documents the bearer token in /docs; Guard enforces it before the body is read.
_bearer = HTTPBearer(auto_error=False, description="the daemon's token, required on writes when configured")


def _install_routes(app: FastAPI) -> None:
    auth = [Depends(_bearer)]

    @app.post("/v1/ranks", status_code=201, response_model=RegisterResponse, responses=_ERRORS, dependencies=auth, tags=["ranks"])
    async def register(body: RegisterRequest, request: Request) -> RegisterResponse:
        """Register a rank with its contract, endpoints and pool descriptors; returns its id and lease."""
        return _registry(request).register(body)

    @app.post("/v1/ranks/{rank_id}/heartbeat", response_model=HeartbeatResponse, responses=_ERRORS, dependencies=auth, tags=["ranks"])
    async def heartbeat(rank_id: str, request: Request) -> HeartbeatResponse:
        """Renew a lease. 404 means the daemon no longer knows the rank: register again."""
        return _registry(request).heartbeat(rank_id)

    @app.delete("/v1/ranks/{rank_id}", status_code=204, responses=_ERRORS, dependencies=auth, tags=["ranks"])
    async def deregister(rank_id: str, request: Request) -> Response:
        _registry(request).deregister(rank_id)
        return Response(status_code=204)

    @app.get("/v1/ranks/{rank_id}", response_model=RankDetail, responses=_ERRORS, tags=["ranks"])
    async def rank(rank_id: str, request: Request) -> RankDetail:
        """One registered rank: its identity, endpoints, pool and aux-region descriptors. A prefill
        rank checks a decode rank's requests against what that rank registered here."""
        return _registry(request).rank(rank_id)

    @app.post("/v1/lookup", response_model=LookupResponse, responses=_ERRORS, dependencies=auth, tags=["handshake"])
    async def lookup(body: LookupRequest, request: Request) -> LookupResponse:
        """The senders of a room (tp_rank 0 of every CP rank and PP stage of the chosen DP group),
        the owner-lane plan and the prefill fingerprint; 409 with the field diff on mismatch."""
        return _registry(request).lookup(body)

    @app.get("/v1/instances", response_model=list[InstanceView], tags=["diagnostics"])
    async def instances(request: Request) -> list[InstanceView]:
        return _registry(request).instances()

    @app.get("/v1/instances/{name}", response_model=InstanceView, responses=_ERRORS, tags=["diagnostics"])
    async def instance(name: str, request: Request) -> InstanceView:
        return _registry(request).instance(name)

    @app.get("/v1/diagnostics/fingerprints", response_model=list[InstanceFingerprint], tags=["diagnostics"])
    async def fingerprints(request: Request) -> list[InstanceFingerprint]:
        return _registry(request).fingerprints()

    @app.get("/v1/diagnostics/mismatches", response_model=list[MismatchRecord], tags=["diagnostics"])
    async def mismatches(request: Request, limit: int | None = Query(default=None, ge=1, le=10_000)) -> list[MismatchRecord]:
        """Recent refusals, newest first."""
        return _registry(request).mismatches(limit)

    @app.get("/diagnostics", response_class=HTMLResponse, tags=["diagnostics"])
    async def diagnostics_page(request: Request) -> HTMLResponse:
        reg = _registry(request)
        html = render_diagnostics(reg.instances(), reg.fingerprints(), reg.mismatches())
        csp = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
        return HTMLResponse(html, headers={"Content-Security-Policy": csp, "Cache-Control": "no-store"})

    @app.get("/healthz", tags=["operations"])
    async def healthz(request: Request) -> dict[str, Any]:
        n_instances, n_ranks = _registry(request).counts()
        return {"status": "ok", "version": kvbridge.__version__, "instances": n_instances, "ranks": n_ranks,
                "uptime_s": round(time.time() - request.app.state.started, 3)}

    @app.get("/metrics", response_class=PlainTextResponse, tags=["operations"])
    async def metrics(request: Request) -> PlainTextResponse:
        text = request.app.state.metrics.render(_registry(request).gauges())
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

