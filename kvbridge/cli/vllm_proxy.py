"""``kvbridge vllm-proxy``: the front of a vLLM prefill/decode pair whose servers run
kvbridge's connector (``kvbridge.integrations.vllm``).

vLLM's P/D request flow, per request:

    client --> proxy --(1) prompt, max_tokens 1, kv_transfer_params
                  |        {"do_remote_decode": true, "kvbridge_room": R}   --> prefill server
                  |    <-- prefill's response: kv_transfer_params {"do_remote_prefill": true,
                  |        "kvbridge_room": R, "kvbridge_instance": ..., ...}
                  +--(2) the client's request as it came, with those params   --> decode server
    client <-- decode's response (streamed through when the client asked for a stream)

The proxy is the router of DESIGN.md: it draws the room id (63 random bits) unless the client
named one. It knows nothing of blocks: decode's connector hands its block ids to prefill over
kvbridge's own control path. Several ``--prefill`` / ``--decode`` servers are taken in turn.

A failure is the client's failure, never a success: a prefill that answers with an error, or
without ``kv_transfer_params`` (not started as ``kv_producer``), or that cannot be reached, ends
the request with 502 and the reason, and decode is not asked; decode's own errors pass through
with their status; a decode that dies mid-request ends a plain request with 502 and cuts a
stream short (no ``data: [DONE]``). Every upstream call is bounded by ``--timeout``.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (``Request``,
# imported inside create_app so that `kvbridge --help` does not import FastAPI) as objects.
import argparse
import itertools
import json
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("kvbridge.vllm_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
ROOM_BITS = 63


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vllm-proxy",
        help="front a vLLM prefill/decode pair that runs kvbridge's connector",
        description=(
            "Serve vLLM's OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models) in front of "
            "vLLM prefill and decode servers started with kvbridge's connector: each request goes to a "
            "prefill server with max_tokens 1 and kv_transfer_params {\"do_remote_decode\": true, "
            "\"kvbridge_room\": R}, then to a decode server with the kv_transfer_params prefill returned. "
            "An error on either side is the client's error (502 with the reason when prefill fails or "
            "a server cannot be reached), never a success. See docs/vllm.md."
        ),
        epilog="example: kvbridge vllm-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000",
    )
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill server (kv_role kv_producer); repeat for several, taken in turn")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode server (kv_role kv_consumer); repeat for several, taken in turn")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port to this file once listening")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one upstream request may take, prefill or decode (default: 600)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvbridge.errors import ConfigError

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
    app = create_app(args.prefill, args.decode, timeout=args.timeout)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    log.warning("%s", message)
    return JSONResponse({"error": {"message": message, "type": "kvbridge_proxy_error", "code": status}},
                        status_code=status)  # fmt: skip


def prefill_request(body: dict[str, Any], room: int) -> dict[str, Any]:
    """The request prefill sees: one token, no stream, and the params that make it a producer."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "kvbridge_room": room})
    if "max_completion_tokens" in body:  # chat: vLLM reads either
        out["max_completion_tokens"] = 1
    return out


def room_of(body: dict[str, Any]) -> int:
    """The client's own room id (``kv_transfer_params.kvbridge_room``) or 63 random bits."""
    given = (body.get("kv_transfer_params") or {}).get("kvbridge_room")
    if given is None:
        return secrets.randbits(ROOM_BITS) or 1
    if not isinstance(given, int) or isinstance(given, bool) or not 0 < given < 1 << ROOM_BITS:
        raise ValueError(f"kv_transfer_params.kvbridge_room must be an integer in [1, 2**63), got {given!r}")
    return given


def create_app(prefills: Sequence[str], decodes: Sequence[str], *, timeout: float = 600.0) -> Any:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    limits = httpx.Timeout(timeout, connect=10.0)
    state: dict[str, Any] = {}
    next_prefill = itertools.cycle([u.rstrip("/") for u in prefills]).__next__
    next_decode = itertools.cycle([u.rstrip("/") for u in decodes]).__next__

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=limits, trust_env=False) as client:
            state["client"] = client
            yield

    app = FastAPI(title="kvbridge vllm-proxy", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Any:
        client: httpx.AsyncClient = state["client"]
        down = []
        for url in (*prefills, *decodes):
            try:
                ok = (await client.get(f"{url.rstrip('/')}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        if down:
            return _error(503, f"not healthy: {', '.join(down)}")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        url = next_decode()
        try:
            r = await state["client"].get(f"{url}/v1/models")
        except httpx.HTTPError as exc:
            return _error(502, f"decode {url} failed: {type(exc).__name__}: {exc}")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def forward(route: str, request: Request) -> Any:
        client: httpx.AsyncClient = state["client"]
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            room = room_of(body)
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(400, f"bad request: {exc}")
        prefill, decode = next_prefill(), next_decode()
        try:
            r = await client.post(f"{prefill}{route}", json=prefill_request(body, room))
        except httpx.HTTPError as exc:
            return _error(502, f"room {room}: prefill {prefill} failed: {type(exc).__name__}: {exc}")
        if r.status_code != 200:
            return _error(502, f"room {room}: prefill {prefill} answered {r.status_code}: {r.text[:2000]}")
        try:
            params = r.json().get("kv_transfer_params")
        except ValueError:
            params = None
        if not isinstance(params, dict):
            return _error(502, f"room {room}: prefill {prefill} returned no kv_transfer_params (is it started "
                               "with kvbridge's connector as kv_producer?)")  # fmt: skip
        decode_body = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            try:
                d = await client.post(f"{decode}{route}", json=decode_body)
            except httpx.HTTPError as exc:
                return _error(502, f"room {room}: decode {decode} failed: {type(exc).__name__}: {exc}")
            return Response(d.content, status_code=d.status_code,
                            media_type=d.headers.get("content-type", "application/json"))  # fmt: skip
        req = client.build_request("POST", f"{decode}{route}", json=decode_body)
        try:
            d = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"room {room}: decode {decode} failed: {type(exc).__name__}: {exc}")
        if d.status_code != 200:
            content = await d.aread()
            await d.aclose()
            return Response(content, status_code=d.status_code, media_type=d.headers.get("content-type"))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in d.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # cut short: the client sees no [DONE]
                log.warning("room %d: decode %s stream broke: %s: %s", room, decode, type(exc).__name__, exc)
            finally:
                await d.aclose()

        return StreamingResponse(relay(), status_code=200, media_type=d.headers.get("content-type"))

    def handler(route: str) -> Any:
        async def handle(request: Request) -> Any:
            return await forward(route, request)

        return handle

    for route in ROUTES:
        app.add_api_route(route, handler(route), methods=["POST"], response_model=None)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Any:
        return JSONResponse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "kvbridge_proxy_error"}},
                            status_code=500)  # fmt: skip

    return app
