"""Every non-2xx answer of the daemon is an ``ErrorBody``: ``{"error": code, "message": ...,
"field": ...}`` plus ``diff`` / ``missing`` / ``fields`` where they apply.

    status  error code                                  when
    400     malformed_json, json_too_deep, bad_request    the body is not JSON, or nests past the parser's limit
            bad_endpoint: a session or control endpoint that is not one canonical address, or
            one this daemon's mode refuses (bootstrap/endpoints.py); the message says why
    401     missing_token, wrong_token                    bearer token (writes; reads with --read-token)
    403     lease_secret_required, wrong_lease_secret     a rank's heartbeat, deregistration or replacement
    404     unknown_rank, unknown_instance, not_found
    405     method_not_allowed
    409     contract_mismatch (diff), topology_mismatch (diff), lease_held (Retry-After),
            claim_held (holder): the transport session or an address range is another live rank's,
            inconsistent_request: the body matches the OpenAPI schema but breaks a rule the
            schema cannot express (a rank outside its sizes, a source digest that does not match
            its files, duplicate names ...); the message names the rule and the field
    413     body_too_large;  415 unsupported_media_type
    422     invalid_request (fields): the body does not match the OpenAPI schema
    429     too_many_ranks, too_many_instances, too_many_lookups, too_many_requests (Retry-After)
    503     instance_incomplete (missing, Retry-After), store_unavailable (the store's cause named:
            etcd quorum lost or members unreachable; Retry-After)

So the schema and the validation agree: whatever ``/openapi.json`` accepts is never
answered 422.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from kvbridge.bootstrap.schemas import ErrorBody
from kvbridge.bootstrap.store import StoreUnavailable
from kvbridge.errors import (
    BufferSpecError,
    ClaimHeld,
    EndpointError,
    ContractMismatch,
    InstanceIncomplete,
    KVBridgeError,
    LeaseHeld,
    LimitExceeded,
    TopologyError,
    Unauthorized,
    UnknownInstance,
)

__all__ = ["error_response", "install_handlers", "status_of", "ERROR_RESPONSES"]

# pydantic error types raised by our own validators: rules beyond what the schema says
_RULE_ERRORS = frozenset({"value_error", "assertion_error"})
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}

# for the OpenAPI document: every error status answers an ErrorBody
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 415, 422, 429, 503)
}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    full = ErrorBody(error=code, message=message, **extra).model_dump(mode="json")
    body = {k: v for k, v in full.items() if v is not None}  # top level only: a diff value may be null
    return JSONResponse(body, status_code=status, headers=headers)


def status_of(exc: KVBridgeError) -> tuple[int, str]:
    if isinstance(exc, ContractMismatch):
        return 409, "contract_mismatch"
    if isinstance(exc, TopologyError):
        return 409, "topology_mismatch"
    if isinstance(exc, LeaseHeld):
        return 409, "lease_held"
    if isinstance(exc, ClaimHeld):
        return 409, "claim_held"
    if isinstance(exc, EndpointError):
        return 400, "bad_endpoint"
    if isinstance(exc, InstanceIncomplete):
        return 503, "instance_incomplete"
    if isinstance(exc, StoreUnavailable):
        return 503, "store_unavailable"
    if isinstance(exc, UnknownInstance):
        return 404, "unknown_rank" if exc.field == "rank_id" else "unknown_instance"
    if isinstance(exc, Unauthorized):
        return 403, getattr(exc, "code", "wrong_lease_secret")
    if isinstance(exc, LimitExceeded):
        return 429, getattr(exc, "code", "limit_exceeded")
    if isinstance(exc, BufferSpecError):
        return 409, "inconsistent_request"  # descriptors that contradict the body's own contract
    return 400, "bad_request"


def _retry_after(seconds: float | None) -> dict[str, str] | None:
    return None if seconds is None else {"Retry-After": str(max(1, math.ceil(seconds)))}


def field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc[1:]] if loc and loc[0] == "body" else [str(p) for p in loc]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of ``request``'s path answers. Starlette's own 405 names only the
    first route whose path matched (``GET /v1/ranks/{id}`` and ``DELETE /v1/ranks/{id}`` are two
    routes), so its ``Allow`` header left the others out."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "\x00"})  # a method no route has: PARTIAL on a path match
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVBridgeError)
    async def kvbridge_error(request: Request, exc: KVBridgeError) -> JSONResponse:
        status, code = status_of(exc)
        headers = None
        if status == 503:
            headers = _retry_after(1)
        elif isinstance(exc, (LeaseHeld, LimitExceeded)):
            headers = _retry_after(exc.retry_after)
        diff = getattr(exc, "diff", None)
        missing = exc.missing if isinstance(exc, InstanceIncomplete) else None
        return error_response(status, code, str(exc), headers=headers, field=exc.field, diff=diff or None, missing=missing,
                              holder=getattr(exc, "holder", None) or None)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            e = errors[0]
            where = (e.get("ctx") or {}).get("error", "")
            return error_response(400, "malformed_json", f"body is not valid JSON: {where} at byte {e['loc'][-1]}", field="body")
        fields = [{"field": field_of(tuple(e["loc"])), "message": e["msg"], "type": e["type"]} for e in errors]
        summary = "; ".join(f"{f['field']}: {f['message']}" for f in fields[:5])
        if all(e["type"] in _RULE_ERRORS for e in errors):  # schema-valid, but a cross-field rule is broken
            return error_response(409, "inconsistent_request", f"request breaks a rule: {summary}",
                                  field=fields[0]["field"], fields=fields)
        return error_response(422, "invalid_request", f"invalid request body: {summary}", field=fields[0]["field"], fields=fields)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 405:
            allowed = allowed_methods(request)
            return error_response(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}; "
                                  f"allowed: {', '.join(allowed)}", headers={"Allow": ", ".join(allowed)})
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            return error_response(400, "json_too_deep", "body nests JSON deeper than the parser allows "
                                  "(about 1,000 levels); no kvbridge body needs more than 10", field="body")
        code = _HTTP_CODES.get(exc.status_code, "bad_request" if exc.status_code == 400 else f"http_{exc.status_code}")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400:
            message = f"body could not be parsed: {exc.__cause__ or message}"[:300]
        return error_response(exc.status_code, code, message, headers=getattr(exc, "headers", None))
