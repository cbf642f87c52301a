"""``kvbridge vllm-proxy``: the front of vLLM prefill/decode servers that run kvbridge's
connector (``kvbridge.integrations.vllm``). It imports kvbridge's public API only.

vLLM's P/D request flow, per request (per prompt of a batch):

    client --> proxy --(1) prompt, max_tokens 1, kv_transfer_params {"do_remote_decode": true}
                  |                                                        --> a prefill server
                  |    <-- kv_transfer_params {"do_remote_prefill": true, "kvbridge_room": R,
                  |        "kvbridge_instance": ..., "kvbridge_num_tokens": N, ...}
                  +--(2) the client's request as it came, with those params --> a decode server
    client <-- decode's response (streamed through when the client asked for a stream)

Rooms: prefill's connector draws the room id from vLLM's request id (one per sub-request of a
batch) and opens it bound to the prompt (``kvbridge.room_binding``), so a room id is never the
client's to choose: a request carrying ``kv_transfer_params`` is refused with 400 unless the
proxy runs with ``--allow-client-rooms`` (a router that chooses rooms; with ``room_key`` in the
connectors' config the room must then be signed: ``kvbridge.sign_room``).

Answers: prefill's 4xx (a bad parameter, an unknown model, a prompt too long) reach the client
unchanged; prefill's other failures, a prefill that returns no ``kv_transfer_params``, or a
server that cannot be reached end the request with 502 naming the side, and decode is not
asked; decode's own answers pass through with their status. A decode that dies mid-stream ends
the stream with an error event and no ``data: [DONE]``. A client that leaves cancels both legs
(the upstream connection is closed: vLLM aborts the request). Request headers (an API key)
are forwarded to both legs.

Fallbacks: prefill answers a request whose room it refused (a room id in use, a bad signature, a
room its worker could not open or send) with ``kvbridge_fallback`` (the reason) and no room: the
proxy passes those params to decode, which computes the prompt itself (the tokens are right, the
transfer is lost), and counts it by reason (``kvbridge_proxy_fallbacks_total``).

Choice and failover: prefill and decode servers are taken in turn; a server that cannot be
reached (connection refused or timed out before any answer) is skipped for ``DOWN_S`` seconds
and the request goes to the next one of that side (a decode that was never reached never
claimed the room, so another decode may). ``/health``: 200 while at least one prefill and one
decode answer their ``/health``; ``/metrics``: Prometheus counters of requests by outcome and
upstream failures by side and reason, fallbacks to decode's local compute by reason.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (``Request``,
# imported inside create_app so that `kvbridge --help` does not import FastAPI) as objects.
import argparse
import asyncio
import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import Any

from kvbridge import ConfigError

log = logging.getLogger("kvbridge.vllm_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
ROOM_BITS = 63
DOWN_S = 5.0  # a server that could not be reached is skipped this long
# not forwarded: hop-by-hop, and what httpx sets for the body it sends
DROPPED_HEADERS = frozenset({"host", "content-length", "content-type", "connection", "keep-alive", "transfer-encoding",
                             "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding"})


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vllm-proxy",
        help="front vLLM prefill/decode servers that run kvbridge's connector",
        description=(
            "Serve vLLM's OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models) in front of "
            "vLLM prefill and decode servers started with kvbridge's connector: each prompt goes to a "
            "prefill server with max_tokens 1 and kv_transfer_params {\"do_remote_decode\": true}, then to a "
            "decode server with the kv_transfer_params prefill returned (the room, bound to the prompt). "
            "Prefill's 4xx pass through unchanged; its other failures and unreachable servers are 502 naming "
            "the side; never a success. Also /health and /metrics. See docs/vllm.md."
        ),
        epilog="example: kvbridge vllm-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000",
    )
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill server (kv_role kv_producer); repeat for several, taken in turn, failover")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode server (kv_role kv_consumer); repeat for several, taken in turn, failover")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port to this file once listening")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one upstream request may take, prefill or decode (default: 600)")
    p.add_argument("--allow-client-rooms", action="store_true",
                   help="pass a client's kv_transfer_params (kvbridge_room and its signature) to prefill; off: such "
                        "a request is refused with 400 (room ids are the cluster's, docs/vllm.md)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {args.timeout}", field="timeout")
    for url in (*args.prefill, *args.decode):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{url!r} is not an http(s) URL", field="prefill/decode")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)  # fmt: skip
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", field="port") from exc
    sock.listen(1024)
    bound = sock.getsockname()[1]
    log.info("kvbridge vllm-proxy on http://%s:%d: prefill %s, decode %s", args.host, bound,
             ", ".join(args.prefill), ", ".join(args.decode))  # fmt: skip
    if args.port_file is not None:
        tmp = args.port_file.with_name(args.port_file.name + f".{os.getpid()}.tmp")
        tmp.write_text(f"{bound}\n")
        tmp.replace(args.port_file)
    app = create_app(args.prefill, args.decode, timeout=args.timeout, allow_client_rooms=args.allow_client_rooms)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


# -- the requests each side sees (pure) -----------------------------------------------------------

def prefill_request(body: dict[str, Any], room: int | None = None) -> dict[str, Any]:
    """The request prefill sees: one token, no stream, no minimum, and the params that make it a
    producer (``room``: a router's room id; None: prefill draws it)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens",
                                                       "min_tokens", "kv_transfer_params")}
    params = {**(body.get("kv_transfer_params") or {}), "do_remote_decode": True}
    if room is not None:
        params["kvbridge_room"] = room
    out.update(max_tokens=1, stream=False, kv_transfer_params=params)
    if "max_completion_tokens" in body:  # chat: vLLM reads either
        out["max_completion_tokens"] = 1
    return out


def client_params(body: dict[str, Any], allow: bool) -> None:
    """A client's ``kv_transfer_params``: refused (ValueError) unless ``allow``; then its room
    must be a 63-bit integer (its signature is the connector's to check)."""
    given = body.get("kv_transfer_params")
    if given is None:
        return
    if not allow:
        raise ValueError("kv_transfer_params are the proxy's to set: room ids are chosen by the cluster (start the "
                         "proxy with --allow-client-rooms for a router that signs its rooms)")
    if not isinstance(given, dict):
        raise ValueError("kv_transfer_params must be an object")
    room = given.get("kvbridge_room")
    if room is not None and (not isinstance(room, int) or isinstance(room, bool) or not 0 < room < 1 << ROOM_BITS):
        raise ValueError(f"kv_transfer_params.kvbridge_room must be an integer in [1, 2**63), got {room!r}")


def split_batch(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A completion request with several prompts as one request per prompt (each its own room);
    None for one prompt (a string, a list of token ids, or a list of one)."""
    prompts = body.get("prompt")
    if not isinstance(prompts, list) or len(prompts) < 2 or not all(isinstance(p, (str, list)) for p in prompts):
        return None
    return [{**body, "prompt": p} for p in prompts]


def merge_batch(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The answers of a batch's sub-requests as one: choices renumbered in prompt order (``n``
    choices per prompt), usage summed."""
    out = dict(answers[0])
    choices, usage = [], Counter()
    for answer in answers:
        for c in answer.get("choices") or []:
            choices.append({**c, "index": len(choices)})
        for k, v in (answer.get("usage") or {}).items():
            if isinstance(v, int):
                usage[k] += v
    out["choices"] = choices
    if usage:
        out["usage"] = dict(usage)
    out.pop("kv_transfer_params", None)
    return out


def forwarded_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in DROPPED_HEADERS}


class Upstreams:
    """One side's servers: taken in turn, those that could not be reached skipped for DOWN_S."""

    def __init__(self, side: str, urls: Sequence[str]) -> None:
        self.side = side
        self.urls = [u.rstrip("/") for u in urls]
        self.down_until = {u: 0.0 for u in self.urls}
        self.next = 0

    def order(self, now: float) -> list[str]:
        """Every server once, starting with the next in turn; those marked down last."""
        start, self.next = self.next, (self.next + 1) % len(self.urls)
        turn = self.urls[start:] + self.urls[:start]
        return [u for u in turn if self.down_until[u] <= now] + [u for u in turn if self.down_until[u] > now]

    def mark_down(self, url: str, now: float) -> None:
        self.down_until[url] = now + DOWN_S


class _Failed(Exception):
    """An upstream leg ended the request: ``response`` is the client's answer."""

    def __init__(self, response: Any) -> None:
        super().__init__()
        self.response = response


def create_app(prefills: Sequence[str], decodes: Sequence[str], *, timeout: float = 600.0,
               allow_client_rooms: bool = False) -> Any:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    limits = httpx.Timeout(timeout, connect=10.0)
    unreachable = (httpx.ConnectError, httpx.ConnectTimeout)
    sides = {"prefill": Upstreams("prefill", prefills), "decode": Upstreams("decode", decodes)}
    counts: Counter[tuple[str, ...]] = Counter()

    def error(status: int, message: str, outcome: str) -> Any:
        counts[("requests", outcome)] += 1
        log.warning("%s", message)
        return JSONResponse({"error": {"message": message, "type": "kvbridge_proxy_error", "code": status}},
                            status_code=status)  # fmt: skip

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=limits, trust_env=False) as client:
            app.state.client = client
            yield

    app = FastAPI(title="kvbridge vllm-proxy", lifespan=lifespan)

    async def healthy(client: Any, url: str) -> bool:
        try:
            return (await client.get(f"{url}/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    @app.get("/health")
    async def health(request: Request) -> Any:
        client = request.app.state.client
        report = {side: {u: await healthy(client, u) for u in s.urls} for side, s in sides.items()}
        down = [u for per in report.values() for u, ok in per.items() if not ok]
        if not all(any(per.values()) for per in report.values()):
            return JSONResponse({"status": "unavailable", "down": down,
                                 "error": {"message": f"not healthy: {', '.join(down)}"}}, status_code=503)
        return {"status": "ok", "down": down}

    @app.get("/metrics")
    async def metrics() -> Any:
        lines = ["# TYPE kvbridge_proxy_requests_total counter"]
        lines += [f'kvbridge_proxy_requests_total{{outcome="{k[1]}"}} {v}' for k, v in sorted(counts.items())
                  if k[0] == "requests"]
        lines += ["# TYPE kvbridge_proxy_upstream_failures_total counter"]
        lines += [f'kvbridge_proxy_upstream_failures_total{{side="{k[1]}",reason="{k[2]}"}} {v}'
                  for k, v in sorted(counts.items()) if k[0] == "upstream"]
        lines += ["# TYPE kvbridge_proxy_fallbacks_total counter"]
        lines += [f'kvbridge_proxy_fallbacks_total{{reason="{k[1]}"}} {v}' for k, v in sorted(counts.items())
                  if k[0] == "fallback"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        url = sides["decode"].order(time.monotonic())[0]
        try:
            r = await request.app.state.client.get(f"{url}/v1/models", headers=forwarded_headers(request.headers))
        except httpx.HTTPError as exc:
            return error(502, f"decode {url} failed: {type(exc).__name__}: {exc}", "upstream_error")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def post(side: str, client: Any, route: str, body: dict[str, Any], headers: dict[str, str],
                   stream: bool = False) -> tuple[str, Any]:
        """POST to a server of ``side``, failing over to the next while one cannot be reached."""
        ups = sides[side]
        last: Exception | None = None
        for url in ups.order(time.monotonic()):
            req = client.build_request("POST", f"{url}{route}", json=body, headers=headers)
            try:
                return url, await client.send(req, stream=stream)
            except unreachable as exc:
                counts[("upstream", side, "unreachable")] += 1
                ups.mark_down(url, time.monotonic())
                log.warning("%s %s unreachable (%s); trying the next", side, url, type(exc).__name__)
                last = exc
            except httpx.HTTPError as exc:
                counts[("upstream", side, type(exc).__name__)] += 1
                raise _Failed(error(502, f"{side} {url} failed: {type(exc).__name__}: {exc}", "upstream_error"))
        raise _Failed(error(502, f"{side} {', '.join(ups.urls)} failed: {type(last).__name__}: {last}",
                            "upstream_error"))

    async def prefilled(client: Any, route: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """Leg 1: the params prefill returned; a 4xx passes through as it came."""
        url, r = await post("prefill", client, route, prefill_request(body), headers)
        if 400 <= r.status_code < 500:
            counts[("requests", "client_error")] += 1
            raise _Failed(Response(r.content, status_code=r.status_code,
                                   media_type=r.headers.get("content-type", "application/json")))
        if r.status_code != 200:
            counts[("upstream", "prefill", f"status_{r.status_code}")] += 1
            raise _Failed(error(502, f"prefill {url} answered {r.status_code}: {r.text[:2000]}", "upstream_error"))
        try:
            params = r.json().get("kv_transfer_params")
        except ValueError:
            params = None
        if not isinstance(params, dict):
            counts[("upstream", "prefill", "no_params")] += 1
            raise _Failed(error(502, f"prefill {url} returned no kv_transfer_params (is it started with kvbridge's "
                                     "connector as kv_producer?)", "upstream_error"))
        fallback = params.get("kvbridge_fallback")
        if fallback is not None:  # no room: decode computes the prompt itself
            reason = str(fallback)[:64]
            counts[("fallback", reason)] += 1
            log.warning("prefill %s answered without a room (%s): decode computes the prompt", url, reason)
        return params

    async def one(client: Any, route: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """Both legs of one prompt, not streamed: decode's answer (status, bytes, type)."""
        params = await prefilled(client, route, body, headers)
        url, d = await post("decode", client, route, {**body, "kv_transfer_params": params}, headers)
        return d

    async def cancelled_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
        """``work``, cancelled (its upstream connections closed: vLLM aborts) if the client leaves."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                counts[("requests", "client_left")] += 1
                log.info("client left: both legs cancelled")
                return Response(status_code=499)

    async def forward(route: str, request: Request) -> Any:
        client = request.app.state.client
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            client_params(body, allow_client_rooms)
        except (ValueError, json.JSONDecodeError) as exc:
            return error(400, f"bad request: {exc}", "client_error")
        headers = forwarded_headers(request.headers)
        batch = split_batch(body) if route == "/v1/completions" else None
        if batch is not None and body.get("stream"):
            return error(400, "bad request: a stream of several prompts is not served by kvbridge vllm-proxy; send "
                              "one request per prompt, or leave stream off", "client_error")
        try:
            if batch is not None:
                return await cancelled_on_disconnect(request, batch_answer(client, route, batch, headers))
            if not body.get("stream"):
                d = await cancelled_on_disconnect(request, one(client, route, body, headers))
                if isinstance(d, Response):
                    return d
                counts[("requests", "ok" if d.status_code == 200 else f"decode_{d.status_code}")] += 1
                return Response(d.content, status_code=d.status_code,
                                media_type=d.headers.get("content-type", "application/json"))  # fmt: skip
            params = await prefilled(client, route, body, headers)
            url, d = await post("decode", client, route, {**body, "kv_transfer_params": params}, headers, stream=True)
        except _Failed as failed:
            return failed.response
        if d.status_code != 200:
            content = await d.aread()
            await d.aclose()
            counts[("requests", f"decode_{d.status_code}")] += 1
            return Response(content, status_code=d.status_code, media_type=d.headers.get("content-type"))
        return StreamingResponse(relay(d, url, params.get("kvbridge_room")), status_code=200,
                                 media_type=d.headers.get("content-type"))

    async def batch_answer(client: Any, route: str, batch: list[dict[str, Any]], headers: dict[str, str]) -> Any:
        answers = await asyncio.gather(*(one(client, route, b, headers) for b in batch), return_exceptions=True)
        for a in answers:  # the first failure is the batch's answer (no partial success)
            if isinstance(a, _Failed):
                return a.response
            if isinstance(a, BaseException):
                raise a
            if a.status_code != 200:
                counts[("requests", f"decode_{a.status_code}")] += 1
                return Response(a.content, status_code=a.status_code, media_type=a.headers.get("content-type"))
        counts[("requests", "ok")] += 1
        return JSONResponse(merge_batch([a.json() for a in answers]))

    async def relay(d: Any, url: str, room: Any) -> AsyncIterator[bytes]:
        done, tail = False, b""
        try:
            async for chunk in d.aiter_raw():
                done = done or b"data: [DONE]" in tail + chunk
                tail = chunk[-16:]
                yield chunk
            if not done:
                raise httpx.RemoteProtocolError("the stream ended without data: [DONE]")
            counts[("requests", "ok")] += 1
        except httpx.HTTPError as exc:  # decode died mid-stream: an error event, then a broken stream
            counts[("upstream", "decode", "stream_broken")] += 1
            counts[("requests", "upstream_error")] += 1
            message = f"room {room}: decode {url} stream broke: {type(exc).__name__}: {exc}"
            log.warning("%s", message)
            event = {"error": {"message": message, "type": "kvbridge_proxy_error", "code": 502}}
            yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            await d.aclose()

    def handler(route: str) -> Any:
        async def handle(request: Request) -> Any:
            return await forward(route, request)

        return handle

    for route in ROUTES:
        app.add_api_route(route, handler(route), methods=["POST"], response_model=None)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Any:
        counts[("requests", "proxy_error")] += 1
        return JSONResponse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "kvbridge_proxy_error"}},
                            status_code=500)  # fmt: skip

    return app
