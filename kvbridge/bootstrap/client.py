"""``BootstrapClient``: what a worker uses to talk to the bootstrap daemon
(sync, httpx), and ``LeaseKeeper``, a thread that keeps a registration alive.

HTTP answers become kvbridge errors where they enter (one mapping, ``_raise_for``):

    401 -> Unauthorized          404 -> UnknownInstance        409 -> ContractMismatch (.diff)
    503 -> InstanceIncomplete (.missing)                            or TopologyError (.diff)
    other 4xx/5xx -> BootstrapError (field named)
    connection refused / timeout / reset, 502 and 504, after ``retries`` retries
    with exponential backoff -> BootstrapUnavailable

A heartbeat answered 404 means the daemon forgot the rank (it restarted, or the
lease expired): the client registers again with the same request and updates
the ``Registration`` in place (new ``rank_id``, ``reregistrations + 1``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.diff import FieldDiff
from kvbridge.bootstrap.schemas import (
    HeartbeatResponse,
    InstanceFingerprint,
    InstanceView,
    LookupRequest,
    LookupResponse,
    MismatchRecord,
    RankIdentity,
    RegisterRequest,
    RegisterResponse,
)
from kvbridge.errors import (
    BootstrapError,
    BootstrapUnavailable,
    ConfigError,
    ContractMismatch,
    InstanceIncomplete,
    KVBridgeError,
    TopologyError,
    Unauthorized,
    UnknownInstance,
)

__all__ = ["BootstrapClient", "Registration", "LeaseKeeper"]

log = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({502, 504})  # a proxy in front of a restarting daemon


@dataclass
class Registration:
    """A live registration; ``heartbeat`` may replace ``rank_id`` after a re-registration."""

    request: RegisterRequest
    rank_id: str
    fingerprint: str
    lease_ttl_s: float
    reregistrations: int = 0

    @property
    def label(self) -> str:
        return self.request.rank.label


def _raise_for(resp: httpx.Response, what: str) -> None:
    if resp.status_code < 400:
        return
    try:
        body: dict[str, Any] = resp.json()
    except ValueError:
        body = {}
    message = f"{what}: {body.get('message') or resp.text[:200] or resp.reason_phrase} (HTTP {resp.status_code})"
    code = body.get("error", "")
    exc: KVBridgeError
    if resp.status_code == 401:
        exc = Unauthorized(message)
    elif resp.status_code == 404:
        exc = UnknownInstance(message)
    elif resp.status_code == 409 and code == "topology_mismatch":
        exc = TopologyError(message)
        exc.diff = [FieldDiff.model_validate(d) for d in body.get("diff") or []]  # type: ignore[attr-defined]
    elif resp.status_code == 409:
        exc = ContractMismatch(message, diff=[FieldDiff.model_validate(d) for d in body.get("diff") or []])
    elif resp.status_code == 503:
        exc = InstanceIncomplete(message, missing=list(body.get("missing") or []))
    else:
        exc = BootstrapError(message)
    exc.field = body.get("field")  # the server already named it in the message
    exc.code = code  # type: ignore[attr-defined]
    raise exc


class BootstrapClient:
    """Sync client of one daemon. Thread-safe (one httpx connection pool)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 2.0,
        retries: int = 3,
        backoff: float = 0.1,
        *,
        transport: httpx.BaseTransport | None = None,
        trust_env: bool = False,
    ) -> None:
        if retries < 0 or backoff < 0 or timeout <= 0:
            raise ConfigError("timeout must be positive, retries and backoff non-negative", field="retries")
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # trust_env=False: a cluster's HTTP(S)_PROXY must not capture daemon traffic.
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport, trust_env=trust_env
        )

    # -- plumbing ---------------------------------------------------------------

    def _request(self, method: str, path: str, what: str, json: Any = None, params: Any = None) -> httpx.Response:
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = self._http.request(method, path, json=json, params=params)
            except httpx.TransportError as exc:
                last = exc
                log.debug("%s: attempt %d failed: %r", what, attempt + 1, exc)
                continue
            if resp.status_code in _RETRY_STATUS:
                last = BootstrapError(f"HTTP {resp.status_code}")
                continue
            _raise_for(resp, what)
            return resp
        raise BootstrapUnavailable(
            f"{what}: bootstrap daemon at {self.base_url} unreachable after {self.retries + 1} attempt(s): {last!r}"
        ) from last

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BootstrapClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- ranks ------------------------------------------------------------------

    def _register(self, request: RegisterRequest) -> RegisterResponse:
        body = request.model_dump(mode="json", exclude_none=True)
        resp = self._request("POST", "/v1/ranks", f"register {request.rank.label}", json=body)
        return RegisterResponse.model_validate_json(resp.content)

    def register(self, request: RegisterRequest) -> Registration:
        """Register a rank; keep the returned ``Registration`` for heartbeats."""
        answer = self._register(request)
        return Registration(request=request, rank_id=answer.rank_id, fingerprint=answer.fingerprint, lease_ttl_s=answer.lease_ttl_s)

    def heartbeat(self, reg: Registration) -> Registration:
        """Renew the lease; registers again (same request) if the daemon forgot the rank."""
        try:
            answer = self._request("POST", f"/v1/ranks/{reg.rank_id}/heartbeat", f"heartbeat {reg.label}")
            reg.lease_ttl_s = HeartbeatResponse.model_validate_json(answer.content).lease_ttl_s
            return reg
        except UnknownInstance:
            log.info("daemon forgot %s (%s): registering again", reg.label, reg.rank_id)
        fresh = self._register(reg.request)
        reg.rank_id, reg.fingerprint, reg.lease_ttl_s = fresh.rank_id, fresh.fingerprint, fresh.lease_ttl_s
        reg.reregistrations += 1
        return reg

    def deregister(self, reg: Registration) -> None:
        """Drop the registration; one the daemon already forgot is fine."""
        try:
            self._request("DELETE", f"/v1/ranks/{reg.rank_id}", f"deregister {reg.label}")
        except UnknownInstance:
            pass

    # -- the handshake ----------------------------------------------------------

    def lookup(
        self,
        prefill_instance: str,
        room: int,
        contract: RuntimeContract,
        rank: RankIdentity,
        dp_rank: int | None = None,
    ) -> LookupResponse:
        """The prefill senders of ``room``. Raises ContractMismatch (``.diff``),
        InstanceIncomplete (``.missing``; poll again), UnknownInstance, Unauthorized."""
        req = LookupRequest(prefill_instance=prefill_instance, room=room, dp_rank=dp_rank, contract=contract, rank=rank)
        resp = self._request(
            "POST", "/v1/lookup", f"lookup room {room} on {prefill_instance!r}", json=req.model_dump(mode="json", exclude_none=True)
        )
        return LookupResponse.model_validate_json(resp.content)

    # -- diagnostics ------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/healthz", "health").json()  # type: ignore[no-any-return]

    def instances(self) -> list[InstanceView]:
        return [InstanceView.model_validate(i) for i in self._request("GET", "/v1/instances", "instances").json()]

    def instance(self, name: str) -> InstanceView:
        return InstanceView.model_validate_json(self._request("GET", f"/v1/instances/{name}", f"instance {name!r}").content)

    def fingerprints(self) -> list[InstanceFingerprint]:
        data = self._request("GET", "/v1/diagnostics/fingerprints", "fingerprints").json()
        return [InstanceFingerprint.model_validate(i) for i in data]

    def mismatches(self, limit: int | None = None) -> list[MismatchRecord]:
        params = {"limit": limit} if limit is not None else None
        data = self._request("GET", "/v1/diagnostics/mismatches", "mismatches", params=params).json()
        return [MismatchRecord.model_validate(m) for m in data]

    def metrics_text(self) -> str:
        return self._request("GET", "/metrics", "metrics").text


class LeaseKeeper:
    """Heartbeats a registration every ``lease_ttl_s / 3`` on a daemon thread.
    Errors are logged and kept in ``last_error``; the thread keeps trying (the
    daemon may be restarting). ``stop()`` returns once the thread has ended."""

    def __init__(self, client: BootstrapClient, registration: Registration, interval_s: float | None = None) -> None:
        if interval_s is not None and interval_s <= 0:
            raise ConfigError(f"heartbeat interval {interval_s}s must be positive", field="interval_s")
        self.client = client
        self.registration = registration
        self.interval_s = interval_s
        self.beats = 0
        self.last_error: KVBridgeError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{registration.label}", daemon=True)

    def _interval(self) -> float:
        return self.interval_s if self.interval_s is not None else self.registration.lease_ttl_s / 3

    def _run(self) -> None:
        while not self._stop.wait(self._interval()):
            try:
                self.client.heartbeat(self.registration)
                self.beats += 1
                self.last_error = None
            except KVBridgeError as exc:
                self.last_error = exc
                log.warning("heartbeat of %s failed: %s", self.registration.label, exc)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0, *, deregister: bool = False) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if deregister:
            self.client.deregister(self.registration)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
