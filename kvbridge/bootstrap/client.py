"""``BootstrapClient``: what a worker uses to talk to the bootstrap daemon
(sync, httpx), and ``LeaseKeeper``, a thread that keeps a registration alive.

HTTP answers become kvbridge errors where they enter (one mapping, ``_raise_for``):

    401, 403 -> Unauthorized     404 -> UnknownInstance        409 -> ContractMismatch (.diff),
    503 -> InstanceIncomplete (.missing)                            TopologyError (.diff)
    429 -> LimitExceeded (.retry_after)                             or LeaseHeld (.retry_after)
    400 bad_endpoint -> EndpointError                               409 claim_held -> ClaimHeld (.holder)
    other 4xx/5xx -> BootstrapError (field named)
    connection refused / timeout / reset, 502 and 504, and 429 with a Retry-After,
    after ``retries`` retries with backoff -> BootstrapUnavailable (or the last 429)
    503 store_unavailable (the replicas' store lost its quorum) -> BootstrapUnavailable,
    naming the daemon's cause, after the same retries, each round waiting the daemon's
    Retry-After (its next health tick; at most 2 s) rather than the backoff

Several daemon replicas (``"http://a:8998,http://b:8998"`` or a list; any replica serves
any request, a heartbeat included): a request goes to the replica that answered last;
a replica that fails (connection, 502/504, 503 store_unavailable) is left for the next
one at once, and only after every replica failed does the client sleep, for a jittered
backoff (``backoff * 2**round``, times 0.5-1.5, so that a thousand ranks whose replicas
restarted together do not come back in step), before the next round.

Per-rank credentials: a registration returns a lease secret, kept in the
``Registration`` and sent (header ``X-KVBridge-Lease``) with its heartbeats, its
deregistration and its re-registrations. A heartbeat answered 404 means the daemon
forgot the rank (it restarted, or the lease expired): the client registers again with
the same request and updates the ``Registration`` in place (new ``rank_id`` and
secret, ``reregistrations + 1``). With ``lease_file`` the secret is also saved
(0600) so that a restarted worker takes its coordinates back at once; without it, a
registration of coordinates that a live lease still holds waits (up to
``lease_wait_s``) for that lease to run out, and then fails with ``LeaseHeld``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
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
    RankDetail,
    RankIdentity,
    RegisterRequest,
    RegisterResponse,
    ScratchDescriptor,
)
from kvbridge.errors import (
    BootstrapError,
    BootstrapUnavailable,
    ClaimHeld,
    EndpointError,
    ConfigError,
    ContractMismatch,
    InstanceIncomplete,
    KVBridgeError,
    LeaseHeld,
    LimitExceeded,
    TopologyError,
    Unauthorized,
    UnknownInstance,
)

__all__ = ["BootstrapClient", "Registration", "LeaseKeeper"]

log = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({502, 504})  # a proxy in front of a restarting daemon
LEASE_HEADER = "X-KVBridge-Lease"
REPLICA_HEADER = "X-KVBridge-Replica"
MAX_RETRY_AFTER_S = 2.0  # a 429's Retry-After is honoured up to this per retry


@dataclass
class Registration:
    """A live registration; ``heartbeat`` may replace ``rank_id`` after a re-registration."""

    request: RegisterRequest
    rank_id: str
    fingerprint: str
    lease_ttl_s: float
    reregistrations: int = 0
    lease_secret: str = ""  # from the daemon; proves this registration is ours

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
    retry_after = _retry_after(resp)
    exc: KVBridgeError
    if resp.status_code in (401, 403):
        exc = Unauthorized(message)
    elif resp.status_code == 404:
        exc = UnknownInstance(message)
    elif resp.status_code == 409 and code == "topology_mismatch":
        exc = TopologyError(message)
        exc.diff = [FieldDiff.model_validate(d) for d in body.get("diff") or []]  # type: ignore[attr-defined]
    elif resp.status_code == 409 and code == "claim_held":
        exc = ClaimHeld(message, holder=str(body.get("holder") or ""))
    elif resp.status_code == 409 and code == "lease_held":
        exc = LeaseHeld(message, retry_after=retry_after or 0.0)
    elif resp.status_code == 409 and code == "contract_mismatch":
        exc = ContractMismatch(message, diff=[FieldDiff.model_validate(d) for d in body.get("diff") or []])
    elif resp.status_code == 400 and code == "bad_endpoint":
        exc = EndpointError(message)
    elif resp.status_code == 429:
        exc = LimitExceeded(message, retry_after=retry_after)
    elif resp.status_code == 503 and code == "store_unavailable":
        exc = BootstrapUnavailable(message)
    elif resp.status_code == 503:
        exc = InstanceIncomplete(message, missing=list(body.get("missing") or []))
    else:
        exc = BootstrapError(message)
    exc.field = body.get("field")  # the server already named it in the message
    exc.code = code  # type: ignore[attr-defined]
    raise exc


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def daemon_urls(base_url: str | Sequence[str]) -> list[str]:
    """``"http://a:8998,http://b:8998"`` or a list of URLs -> the replicas' URLs, checked."""
    items = base_url.split(",") if isinstance(base_url, str) else list(base_url)
    urls = [u.strip().rstrip("/") for u in items if u.strip()]
    if not urls:
        raise ConfigError("no bootstrap daemon URL given", field="bootstrap")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ConfigError(f"bootstrap URL {u!r} must start with http:// or https://", field="bootstrap")
    return urls


def _is_store_down(resp: httpx.Response) -> bool:
    if resp.status_code != 503:
        return False
    try:
        return bool(resp.json().get("error") == "store_unavailable")
    except ValueError:
        return False


class BootstrapClient:
    """Sync client of one daemon or of several replicas of it (failover, see above).
    Thread-safe (one httpx connection pool)."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        token: str | None = None,
        timeout: float = 2.0,
        retries: int = 3,
        backoff: float = 0.1,
        *,
        transport: httpx.BaseTransport | None = None,
        trust_env: bool = False,
        lease_file: str | Path | None = None,
        lease_wait_s: float = 30.0,
        scratch: ScratchDescriptor | None = None,
    ) -> None:
        if retries < 0 or backoff < 0 or timeout <= 0 or lease_wait_s < 0:
            raise ConfigError("timeout must be positive; retries, backoff and lease_wait_s non-negative", field="retries")
        self.urls = daemon_urls(base_url)
        self.base_url = ",".join(self.urls)  # what messages name
        self._current = 0  # index of the replica that answered last
        self.last_replica = ""  # the X-KVBridge-Replica of the last answer
        self.failovers = 0
        self.retries = retries
        self.backoff = backoff
        self.lease_file = Path(lease_file) if lease_file else None  # one rank per client when set
        self.lease_wait_s = lease_wait_s
        self.scratch = scratch  # advertised with every registration that names none (kvbridge doctor probes it)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # trust_env=False: a cluster's HTTP(S)_PROXY must not capture daemon traffic.
        self._http = httpx.Client(headers=headers, timeout=timeout, transport=transport, trust_env=trust_env)

    # -- plumbing ---------------------------------------------------------------

    def _request(self, method: str, path: str, what: str, json: Any = None, params: Any = None,
                 headers: dict[str, str] | None = None) -> httpx.Response:
        last: BaseException | None = None
        down: httpx.Response | None = None  # the last 503 store_unavailable, raised as it is if nothing answers
        pause = 0.0
        n = len(self.urls)
        for attempt in range((self.retries + 1) * n):
            if attempt and attempt % n == 0:  # a whole round of replicas failed: back off, jittered
                rnd = attempt // n
                time.sleep(max(pause, self.backoff * 2 ** (rnd - 1) * random.uniform(0.5, 1.5)))
                pause = 0.0
            i = self._current
            try:
                resp = self._http.request(method, self.urls[i] + path, json=json, params=params, headers=headers)
            except httpx.TransportError as exc:
                last = exc
                log.debug("%s: attempt %d at %s failed: %r", what, attempt + 1, self.urls[i], exc)
                self._next_replica(i)
                continue
            if resp.status_code in _RETRY_STATUS or _is_store_down(resp):
                last = BootstrapError(f"HTTP {resp.status_code} from {self.urls[i]}")
                if resp.status_code == 503:
                    down = resp
                    # the store comes back at the daemon's next health tick (an etcd election, a
                    # member rejoining): its Retry-After is when to ask again, not the backoff
                    pause = max(pause, min(_retry_after(resp) or 0.0, MAX_RETRY_AFTER_S))
                self._next_replica(i)
                continue
            if resp.status_code == 429 and attempt < (self.retries + 1) * n - 1 and (wait := _retry_after(resp)) is not None:
                # a limit that waiting lifts: wait, within the retry budget, then ask the same replica
                time.sleep(min(wait, MAX_RETRY_AFTER_S))
                continue
            self.last_replica = resp.headers.get(REPLICA_HEADER, "")
            _raise_for(resp, what)
            return resp
        if down is not None:
            _raise_for(down, what)  # BootstrapUnavailable naming the store's cause
        raise BootstrapUnavailable(
            f"{what}: {self.where} unreachable after {self.retries + 1} attempt(s){' each' if n > 1 else ''}: {last!r}"
        ) from last

    @property
    def where(self) -> str:
        """How messages name the daemon: "bootstrap daemon at URL", or its replicas."""
        return f"bootstrap daemon at {self.urls[0]}" if len(self.urls) == 1 else f"bootstrap daemons {', '.join(self.urls)}"

    def _next_replica(self, failed: int) -> None:
        if len(self.urls) > 1 and self._current == failed:
            self._current = (failed + 1) % len(self.urls)
            self.failovers += 1

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BootstrapClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- ranks ------------------------------------------------------------------

    @staticmethod
    def _lease(secret: str | None) -> dict[str, str] | None:
        return {LEASE_HEADER: secret} if secret else None

    def _register(self, request: RegisterRequest, secret: str | None) -> RegisterResponse:
        body = request.model_dump(mode="json", exclude_none=True)
        resp = self._request("POST", "/v1/ranks", f"register {request.rank.label}", json=body, headers=self._lease(secret))
        answer = RegisterResponse.model_validate_json(resp.content)
        self._save_lease(request.rank.label, answer.lease_secret)
        return answer

    def _register_waiting(self, request: RegisterRequest, secret: str | None) -> RegisterResponse:
        """Register; while a live lease holds the coordinates (a restarted worker's old
        registration), wait for it to run out, up to ``lease_wait_s``."""
        deadline = time.monotonic() + self.lease_wait_s
        while True:
            try:
                return self._register(request, secret)
            except LeaseHeld as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.info("%s: coordinates held by a live lease; waiting %.1fs for it to run out",
                         request.rank.label, min(left, exc.retry_after))
                time.sleep(min(left, max(0.05, exc.retry_after)))

    def register(self, request: RegisterRequest, lease_secret: str | None = None) -> Registration:
        """Register a rank; keep the returned ``Registration`` for heartbeats. ``lease_secret``
        (or the one saved in ``lease_file``) replaces this rank's earlier registration at once."""
        if self.scratch is not None and request.scratch is None:
            request = request.model_copy(update={"scratch": self.scratch})
        answer = self._register_waiting(request, lease_secret or self._saved_lease(request.rank.label))
        return Registration(request=request, rank_id=answer.rank_id, fingerprint=answer.fingerprint,
                            lease_ttl_s=answer.lease_ttl_s, lease_secret=answer.lease_secret)

    def heartbeat(self, reg: Registration) -> Registration:
        """Renew the lease; registers again (same request) if the daemon forgot the rank."""
        try:
            answer = self._request("POST", f"/v1/ranks/{reg.rank_id}/heartbeat", f"heartbeat {reg.label}",
                                   headers=self._lease(reg.lease_secret))
            reg.lease_ttl_s = HeartbeatResponse.model_validate_json(answer.content).lease_ttl_s
            return reg
        except UnknownInstance:
            log.info("daemon forgot %s (%s): registering again", reg.label, reg.rank_id)
        fresh = self._register(reg.request, reg.lease_secret)  # LeaseHeld: another process holds our coordinates now
        reg.rank_id, reg.fingerprint, reg.lease_ttl_s = fresh.rank_id, fresh.fingerprint, fresh.lease_ttl_s
        reg.lease_secret = fresh.lease_secret
        reg.reregistrations += 1
        return reg

    def deregister(self, reg: Registration) -> None:
        """Drop the registration; one the daemon already forgot is fine."""
        try:
            self._request("DELETE", f"/v1/ranks/{reg.rank_id}", f"deregister {reg.label}", headers=self._lease(reg.lease_secret))
        except UnknownInstance:
            pass
        self._save_lease(reg.label, "")

    # -- the saved lease secret -------------------------------------------------

    def _saved_lease(self, label: str) -> str | None:
        if self.lease_file is None:
            return None
        try:
            saved = json.loads(self.lease_file.read_text())
        except (OSError, ValueError):
            return None
        return saved.get("lease_secret") or None if isinstance(saved, dict) and saved.get("rank") == label else None

    def _save_lease(self, label: str, secret: str) -> None:
        """Write (or, with an empty secret, remove) the lease file atomically, mode 0600."""
        if self.lease_file is None:
            return
        try:
            if not secret:
                self.lease_file.unlink(missing_ok=True)
                return
            tmp = self.lease_file.with_name(f"{self.lease_file.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"rank": label, "lease_secret": secret}, f)
            tmp.replace(self.lease_file)
        except OSError as exc:
            log.warning("cannot keep the lease secret of %s in %s: %s", label, self.lease_file, exc)

    def rank(self, rank_id: str) -> RankDetail:
        """One registered rank and its buffers; UnknownInstance once it is gone."""
        return RankDetail.model_validate_json(self._request("GET", f"/v1/ranks/{rank_id}", f"rank {rank_id!r}").content)

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
            try:
                self.client.deregister(self.registration)
            except BootstrapUnavailable as exc:  # shutting down while the daemon is away: the lease expires
                log.warning("could not deregister %s (its lease will expire): %s", self.registration.rank_id, exc)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
