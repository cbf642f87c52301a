"""The bootstrap daemon as a FastAPI app: ``create_app(...)``.

    POST   /v1/ranks                       register       201 | 400 401 409 413 415 422 429  (400 bad_endpoint: endpoints.py)
    POST   /v1/ranks/{rank_id}/heartbeat   renew lease    200 | 401 403 404 (register again)
    DELETE /v1/ranks/{rank_id}             deregister     204 | 401 403 404
    GET    /v1/ranks/{rank_id}             one rank       200 | 401 404   (its buffers, for prefill's checks)
    POST   /v1/lookup                      handshake      200 | 400 401 404 409 413 415 422 429 503
    GET    /v1/instances[/{name}]          instances      200 | 401 404
    GET    /v1/diagnostics/fingerprints    per instance: fingerprint, contract, ranks
    GET    /v1/diagnostics/mismatches      recent refusals with their field diffs
    GET    /diagnostics                    the same for a person (HTML)
    GET    /healthz, /metrics, /docs, /openapi.json   (always open)

Every answer names the replica that gave it (header ``X-KVBridge-Replica``): with the
etcd store, any number of replicas serve one cluster, and ``/healthz``, ``/metrics`` and
``/diagnostics`` show the store's health and every replica it knows.

State (store, registry, metrics, look-up limiter) is created in the lifespan and lives on
``app.state``. ``Guard`` (guard.py) checks tokens and body size before routing: the
write token on writes, a read-granting token (read, write or admin) on ``/v1`` and
``/diagnostics`` reads whenever any token is configured. Per-rank credentials (lease
secrets, leases.py) and the limits (registry.py, limits.py) are checked by the
routes. Every error body is an ``ErrorBody`` (responses.py lists the codes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from decimal import Decimal
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.responses import HTMLResponse
from fastapi.security import HTTPBearer
from starlette.concurrency import run_in_threadpool

from kvbridge._version import __version__
from kvbridge.bootstrap.endpoints import Resolver, canonical_endpoint, canonical_session, resolve_host
from kvbridge.bootstrap.lapses import DEFAULT_CLAIM_GRACE_S
from kvbridge.bootstrap.reach import claim_key
from kvbridge.bootstrap.guard import ADMIN, LEASE_HEADER, Guard, access_of
from kvbridge.bootstrap.limits import RateLimiter
from kvbridge.bootstrap.metrics import CONTENT_TYPE, Metrics
from kvbridge.bootstrap.page import render_diagnostics
from kvbridge.bootstrap.registry import Registry
from kvbridge.bootstrap.responses import ERROR_RESPONSES, install_handlers
from kvbridge.bootstrap.store import EtcdOptions, RegistryStore
from kvbridge.bootstrap.store_memory import MemoryStore
from kvbridge.bootstrap.schemas import (
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
from kvbridge.errors import ConfigError, EndpointError, LimitExceeded

__all__ = ["BootstrapSettings", "create_app", "REPLICA_HEADER"]

REPLICA_HEADER = "X-KVBridge-Replica"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapSettings:
    token: str | None = None  # write token: every write needs it (or the admin token)
    read_token: str | None = None  # read-only access to /v1 and /diagnostics (any token configured: reads need one)
    admin_token: str | None = None  # operators: replace, renew or drop any rank; read and write
    lease_ttl_s: float = 10.0  # default lease when a rank asks for none
    max_lease_ttl_s: float = 300.0
    max_body_bytes: int = 1 << 20
    max_mismatches: int = 100
    max_ranks_per_instance: int = 1024
    max_instances: int = 1024
    max_lookups_per_s: float = 1000.0  # per asking decode instance; 0: unlimited
    # per client address, look-ups and /v1 reads together: a client that invents a new decode
    # instance name per look-up (a fresh bucket each) still meets this one; 0: unlimited
    max_requests_per_s_per_address: float = 2000.0
    sweep_interval_s: float = 1.0
    etcd: EtcdOptions | None = None  # None: the in-memory store
    replica: str = ""  # this daemon's name among replicas ("" : host:port or a random one)
    url: str = ""  # where clients reach this replica (shown to operators)
    # which hosts a registration may name (bootstrap/endpoints.py): "local" (every rank on this
    # host: loopback only, one spelling), "network" (loopback refused), "auto": ``serve`` picks
    # local when it listens on loopback only, network otherwise; ``create_app`` alone: local
    endpoints: str = "auto"
    # a lapsed claim stays its owner's key's this long (bootstrap/lapses.py)
    claim_grace_s: float = DEFAULT_CLAIM_GRACE_S
    # the in-memory store keeps its claims here too, read back at a restart (None: not kept)
    claims_file: str | None = None
    # ranks registered at once, and engine_metadata characters they hold together (429 over either)
    max_ranks: int = 8192
    max_metadata_chars: int = 64 << 20

    def __post_init__(self) -> None:
        named = {"token": self.token, "read_token": self.read_token, "admin_token": self.admin_token}
        for name, value in named.items():
            if value is not None and not value.strip():
                raise ConfigError(f"bootstrap {name} is empty", field=name)
        given = [v for v in named.values() if v]
        if len(set(given)) != len(given):
            raise ConfigError("the write, read and admin tokens must differ (each grants different rights)", field="admin_token")
        if not 0 < self.lease_ttl_s <= self.max_lease_ttl_s:
            raise ConfigError(f"lease TTL {self.lease_ttl_s}s must be in (0, {self.max_lease_ttl_s}]", field="lease_ttl_s")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max body bytes {self.max_body_bytes} is below 1024", field="max_body_bytes")
        if self.max_mismatches < 1 or self.sweep_interval_s <= 0:
            raise ConfigError("max_mismatches and sweep_interval_s must be positive", field="max_mismatches")
        if self.max_ranks_per_instance < 1 or self.max_instances < 1:
            raise ConfigError("max_ranks_per_instance and max_instances must be >= 1", field="max_ranks_per_instance")
        if self.endpoints not in ("auto", "local", "network"):
            raise ConfigError(f"endpoints {self.endpoints!r} is not auto, local or network", field="endpoints")
        if self.claim_grace_s < 0:
            raise ConfigError("claim_grace_s must be >= 0", field="claim_grace_s")
        if self.max_ranks < 1 or self.max_metadata_chars < 0:
            raise ConfigError("max_ranks must be >= 1 and max_metadata_chars >= 0", field="max_ranks")
        if self.max_lookups_per_s < 0:
            raise ConfigError("max_lookups_per_s must be >= 0 (0: unlimited)", field="max_lookups_per_s")
        if self.max_requests_per_s_per_address < 0:
            raise ConfigError("max_requests_per_s_per_address must be >= 0 (0: unlimited)",
                              field="max_requests_per_s_per_address")


    @property
    def local_endpoints(self) -> bool:
        """Local mode (``endpoints``): "auto" left undecided by ``serve`` is local."""
        return self.endpoints != "network"


def canonical_registration(body: RegisterRequest, *, local: bool, resolve: Resolver = resolve_host) -> RegisterRequest:
    """``body`` with its session and control endpoint in canonical form (bootstrap/endpoints.py),
    so claims, look-ups and prefill's writes all use one spelling; EndpointError (400 bad_endpoint) naming
    the rank and the field when one is refused."""
    try:
        session = canonical_session(body.session_id, local=local, resolve=resolve)
        endpoint = canonical_endpoint(body.control_endpoint, local=local, resolve=resolve)
        claim_key(session, body.engine_metadata)  # what the session reaches must parse (a NIXL worker)
    except EndpointError as exc:
        raise EndpointError(f"{body.rank.label} refused: {exc.reason}", rank=body.rank.label, field=exc.field) from None
    if session == body.session_id and endpoint == body.control_endpoint:
        return body
    return body.model_copy(update={"session_id": session, "control_endpoint": endpoint})


def make_store(settings: BootstrapSettings) -> RegistryStore:
    """The store ``settings`` name, not started (``start()`` connects)."""
    if settings.etcd is None:
        return MemoryStore(max_refusals=settings.max_mismatches,
                           pause_grace_s=max(3 * settings.sweep_interval_s, 2.0),  # the sweep runs every sweep_interval_s
                           claims_file=settings.claims_file, claim_grace_s=settings.claim_grace_s)
    from kvbridge.bootstrap.store_etcd import EtcdStore  # the etcd client only where it is used

    return EtcdStore(settings.etcd, max_refusals=settings.max_mismatches, replica=settings.replica, url=settings.url,
                     claim_grace_s=settings.claim_grace_s)


def create_app(settings: BootstrapSettings | None = None, *, store: RegistryStore | None = None,
               **overrides: Any) -> FastAPI:
    """A fresh daemon; all state is made in its lifespan and kept on ``app.state``.
    ``overrides`` replace fields of ``settings`` (``create_app(token="t")``); an
    unknown name is a TypeError, not silently ignored. ``store``: one already started
    (``serve`` connects before it listens); otherwise the lifespan makes and starts the
    one ``settings`` name, and closes it at shutdown either way."""
    settings = dataclasses.replace(settings or BootstrapSettings(), **overrides)
    replica = settings.replica or (store.replica if store is not None and hasattr(store, "replica") else "")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.settings = settings
        app.state.metrics = Metrics()
        own = store
        if own is None:
            own = make_store(settings)
            await run_in_threadpool(own.start)
        app.state.store = own
        app.state.replica = replica or str(getattr(own, "replica", "")) or "memory"
        app.state.registry = Registry(
            metrics=app.state.metrics,
            default_ttl_s=settings.lease_ttl_s,
            max_ttl_s=settings.max_lease_ttl_s,
            max_mismatches=settings.max_mismatches,
            max_ranks_per_instance=settings.max_ranks_per_instance,
            max_instances=settings.max_instances,
            store=own,
            claim_grace_s=settings.claim_grace_s,
            max_ranks=settings.max_ranks,
            max_metadata_chars=settings.max_metadata_chars,
        )
        app.state.metrics.gauge_source = lambda: app.state.registry.gauges(app.state.replica)
        app.state.lookup_limit = RateLimiter(settings.max_lookups_per_s)
        app.state.address_limit = RateLimiter(settings.max_requests_per_s_per_address)
        app.state.started = time.time()

        async def sweep() -> None:
            while True:
                await asyncio.sleep(settings.sweep_interval_s)
                app.state.registry.expire()

        task = asyncio.create_task(sweep())
        log.info("bootstrap daemon ready (write token %s, read token %s, admin token %s)",
                 *("set" if t else "unset" for t in (settings.token, settings.read_token, settings.admin_token)))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await run_in_threadpool(own.close)

    app = FastAPI(
        title="kvbridge bootstrap daemon",
        version=__version__,
        description="Rank registry, contract fingerprints and prefill-topology lookups for PD disaggregation.",
        lifespan=lifespan,
        dependencies=[Depends(_one_value_per_query_parameter)],
    )
    app.router.route_class = _WholeNumberRoute
    _exact_openapi_bounds(app)
    tokens = {"write": settings.token, "read": settings.read_token, "admin": settings.admin_token}
    app.add_middleware(Guard, tokens=tokens, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(_NameReplica)

    install_handlers(app)
    _install_routes(app, settings)
    return app


class _NameReplica:
    """Adds ``X-KVBridge-Replica`` to every answer (plain ASGI: no per-request task)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = str(getattr(scope["app"].state, "replica", "")).encode()

        async def named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER.lower().encode(), name)]
            await send(message)

        await self.app(scope, receive, named)


def _json_number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when it is a whole number (exactly: no
    f64 rounding of large values), else a float."""
    d = Decimal(text)
    return int(d) if d.is_finite() and d == d.to_integral_value() else float(text)


class _WholeNumberRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = json.loads(await self.body(), parse_float=_json_number)
        return self._json


class _WholeNumberRoute(APIRoute):
    """Bodies are read with whole numbers as ints. JSON Schema's ``integer`` includes ``992.0``
    (and OpenAPI clients send it), but the strict request models refuse a float for an int field;
    reading ``992.0`` as ``992`` keeps them strict about strings and booleans while accepting
    everything the schema allows. Float fields take ints as they are."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def whole_numbers(request: Request) -> Response:
            return await handler(_WholeNumberRequest(request.scope, request.receive))

        return whole_numbers


def _one_value_per_query_parameter(request: Request) -> None:
    """Every query parameter of this API is one value: ``?limit=1&limit=2`` is refused (422
    naming the parameter), where FastAPI would silently take the last."""
    repeated = sorted({k for k, _ in request.query_params.multi_items() if len(request.query_params.getlist(k)) > 1})
    if repeated:
        raise RequestValidationError([{"type": "repeated_parameter", "loc": ("query", name),
                                       "msg": f"query parameter {name!r} given more than once", "input": None}
                                      for name in repeated])


def _exact_openapi_bounds(app: FastAPI) -> None:
    """FastAPI's OpenAPI models hold numeric bounds as floats, so ``lt=2**63`` came out as
    ``9.223372036854776e+18`` and a schema-driven client computed its edge cases in floats (and
    sent values the daemon refuses). Whole-number bounds are written back as exact integers."""
    plain = app.openapi

    def exact(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (int(v) if k in _BOUNDS and isinstance(v, float) and v.is_integer() else exact(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [exact(v) for v in node]
        return node

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = exact(plain())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})


def _per_address(request: Request) -> None:
    """Look-ups and /v1 reads per client address (``--max-requests-per-s-per-address``): 429
    ``too_many_requests`` with Retry-After past it."""
    address = request.client.host if request.client else "?"
    wait = request.app.state.address_limit.take(address)
    if wait > 0:
        request.app.state.metrics.inc("kvbridge_bootstrap_rejected_requests_total", reason="too_many_requests")
        limit = request.app.state.settings.max_requests_per_s_per_address
        exc = LimitExceeded(f"client {address} is over this daemon's limit of {limit:g} look-ups and reads per second "
                            f"(--max-requests-per-s-per-address)", retry_after=wait, field="client")
        exc.code = "too_many_requests"  # type: ignore[attr-defined]
        raise exc


def _registry(request: Request) -> Registry:
    return request.app.state.registry  # type: ignore[no-any-return]


_ERRORS = ERROR_RESPONSES
# an HTML route's errors are still JSON ErrorBody answers: say so explicitly
_HTML_ERRORS: dict[int | str, dict[str, Any]] = {401: {"description": "token missing or refused", "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}}
# Documents the bearer token in /docs when one is configured (an open daemon's schema
# must not claim a header it does not need); Guard enforces it before the body is read.
_bearer = HTTPBearer(auto_error=False, description="the daemon's write token (writes), read token (reads), or admin token")
_Lease = Header(default=None, alias=LEASE_HEADER, description="the rank's lease secret, from its registration")


async def _run(request: Request, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A registry write: on the event loop for the in-memory store (microseconds), in the
    thread pool for a remote one (its round trips must not stall look-ups)."""
    if request.app.state.store.remote:
        return await run_in_threadpool(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _admin(request: Request) -> bool:
    return ADMIN in access_of(request)


def _store_state(request: Request) -> dict[str, Any]:
    """The store's health and the replicas it knows, as every replica reports them."""
    store: RegistryStore = request.app.state.store
    state = store.health().as_dict()
    state["replicas"] = [dataclasses.asdict(r) for r in store.replicas()]
    state["answered_by"] = request.app.state.replica
    return state


def _install_routes(app: FastAPI, settings: BootstrapSettings) -> None:
    auth = [Depends(_bearer)] if settings.token else []  # writes are open without a write token
    # reads need a token whenever any is configured (guard.py says why)
    read_auth = [Depends(_bearer)] if (settings.token or settings.read_token or settings.admin_token) else []
    read_auth = [*read_auth, Depends(_per_address)]

    @app.post("/v1/ranks", status_code=201, response_model=RegisterResponse, responses=_ERRORS, dependencies=auth, tags=["ranks"])
    async def register(body: RegisterRequest, request: Request, lease: str | None = _Lease) -> RegisterResponse:
        """Register a rank with its contract, endpoints and pool descriptors; returns its id, lease and
        lease secret. Coordinates a live rank holds need that rank's lease secret or the admin token."""
        # canonical first, off the loop: a host name is resolved (bootstrap/endpoints.py)
        body = await run_in_threadpool(canonical_registration, body, local=request.app.state.settings.local_endpoints)
        return await _run(request, _registry(request).register, body, lease_secret=lease, admin=_admin(request))

    @app.post("/v1/ranks/{rank_id}/heartbeat", response_model=HeartbeatResponse, responses=_ERRORS, dependencies=auth, tags=["ranks"])
    async def heartbeat(rank_id: str, request: Request, lease: str | None = _Lease) -> HeartbeatResponse:
        """Renew a lease (needs the rank's lease secret). 404 means the daemon no longer knows the rank: register again."""
        return await _run(request, _registry(request).heartbeat, rank_id, lease_secret=lease, admin=_admin(request))

    @app.delete("/v1/ranks/{rank_id}", status_code=204, responses=_ERRORS, dependencies=auth, tags=["ranks"])
    async def deregister(rank_id: str, request: Request, lease: str | None = _Lease) -> Response:
        """Drop a rank (needs its lease secret, or the admin token)."""
        await _run(request, _registry(request).deregister, rank_id, lease_secret=lease, admin=_admin(request))
        return Response(status_code=204)

    @app.get("/v1/ranks/{rank_id}", response_model=RankDetail, responses=_ERRORS, dependencies=read_auth, tags=["ranks"])
    async def rank(rank_id: str, request: Request) -> RankDetail:
        """One registered rank: its identity, endpoints, pool and aux-region descriptors. A prefill
        rank checks a decode rank's requests against what that rank registered here."""
        return _registry(request).rank(rank_id)

    @app.post("/v1/lookup", response_model=LookupResponse, responses=_ERRORS, dependencies=[*auth, Depends(_per_address)],
              tags=["handshake"])
    async def lookup(body: LookupRequest, request: Request) -> LookupResponse:
        """The senders of a room (tp_rank 0 of every CP rank and PP stage of the chosen DP group),
        the owner-lane plan and the prefill fingerprint; 409 with the field diff on mismatch."""
        wait = request.app.state.lookup_limit.take(body.rank.instance)
        if wait > 0:
            request.app.state.metrics.inc("kvbridge_bootstrap_rejected_requests_total", reason="too_many_lookups")
            exc = LimitExceeded(f"decode instance {body.rank.instance!r} is over this daemon's limit of "
                                f"{settings.max_lookups_per_s:g} look-ups per second (--max-lookups-per-s)",
                                retry_after=wait, room=body.room, rank=body.rank.label, field="rank.instance")
            exc.code = "too_many_lookups"  # type: ignore[attr-defined]
            raise exc
        return _registry(request).lookup(body)

    @app.get("/v1/instances", response_model=list[InstanceView], responses=_ERRORS, dependencies=read_auth, tags=["diagnostics"])
    async def instances(request: Request) -> list[InstanceView]:
        return _registry(request).instances()

    @app.get("/v1/instances/{name}", response_model=InstanceView, responses=_ERRORS, dependencies=read_auth, tags=["diagnostics"])
    async def instance(name: str, request: Request) -> InstanceView:
        return _registry(request).instance(name)

    @app.get("/v1/diagnostics/fingerprints", response_model=list[InstanceFingerprint], responses=_ERRORS, dependencies=read_auth, tags=["diagnostics"])
    async def fingerprints(request: Request) -> list[InstanceFingerprint]:
        return _registry(request).fingerprints()

    @app.get("/v1/diagnostics/mismatches", response_model=list[MismatchRecord], responses=_ERRORS, dependencies=read_auth, tags=["diagnostics"])
    async def mismatches(request: Request, limit: int | None = Query(default=None, ge=1, le=10_000)) -> list[MismatchRecord]:
        """Recent refusals, newest first."""
        return _registry(request).mismatches(limit)

    @app.get("/diagnostics", response_class=HTMLResponse, responses=_HTML_ERRORS, dependencies=read_auth, tags=["diagnostics"])
    async def diagnostics_page(request: Request) -> HTMLResponse:
        reg = _registry(request)
        html = render_diagnostics(reg.instances(), reg.fingerprints(), reg.mismatches(), store=_store_state(request))
        csp = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
        return HTMLResponse(html, headers={"Content-Security-Policy": csp, "Cache-Control": "no-store"})

    @app.get("/healthz", tags=["operations"])
    async def healthz(request: Request) -> dict[str, Any]:
        n_instances, n_ranks = _registry(request).counts()
        now = time.time()  # "time": what `kvbridge doctor` compares its clock with
        store = _store_state(request)
        return {"status": "ok" if store["ok"] else "degraded", "version": __version__, "instances": n_instances,
                "ranks": n_ranks, "uptime_s": round(now - request.app.state.started, 3), "time": now,
                "replica": request.app.state.replica, "store": store}

    @app.get("/metrics", response_class=Response, tags=["operations"])
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)

