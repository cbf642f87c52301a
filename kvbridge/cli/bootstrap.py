"""``kvbridge bootstrap``: run the bootstrap daemon (rank registry, contract
fingerprints, prefill-topology lookups, diagnostics)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from kvbridge.errors import ConfigError

TOKEN_ENV = "KVBRIDGE_BOOTSTRAP_TOKEN"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bootstrap",
        help="run the bootstrap daemon",
        description=(
            "Run the bootstrap daemon: ranks register with a lease, decode ranks look up the prefill "
            "topology of a request, contract fingerprints are compared (409 with a field diff on mismatch). "
            "Diagnostics at /diagnostics, metrics at /metrics, OpenAPI at /docs."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8998, help="port to listen on; 0 picks a free one (default: 8998)")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port to this file once listening")
    p.add_argument(
        "--token",
        default=None,
        help=f"bearer token required on every write (default: ${TOKEN_ENV}; none: writes are open)",
    )
    p.add_argument("--token-file", type=Path, default=None, help="read the token from this file (keeps it out of ps)")
    p.add_argument("--lease-ttl", type=float, default=10.0, help="lease in seconds for ranks that ask for none (default: 10)")
    p.add_argument("--max-lease-ttl", type=float, default=300.0, help="longest lease a rank may ask for (default: 300)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default: 1 MiB)")
    p.add_argument("--max-mismatches", type=int, default=100, help="refusals kept for diagnostics (default: 100)")
    p.set_defaults(func=run)


def _token(args: argparse.Namespace) -> str | None:
    if args.token is not None and args.token_file is not None:
        raise ConfigError("give --token or --token-file, not both", field="token")
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read token file {str(args.token_file)!r}: {exc.strerror}", field="token_file") from exc
        if not token:
            raise ConfigError(f"token file {str(args.token_file)!r} is empty", field="token_file")
        return token
    return args.token if args.token is not None else (os.environ.get(TOKEN_ENV) or None)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `kvbridge --help` does not pay for FastAPI.
    from kvbridge.bootstrap.app import BootstrapSettings
    from kvbridge.bootstrap.server import serve

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"port {args.port} is outside 0..65535", field="port")
    settings = BootstrapSettings(
        token=_token(args),
        lease_ttl_s=args.lease_ttl,
        max_lease_ttl_s=args.max_lease_ttl,
        max_body_bytes=args.max_body_bytes,
        max_mismatches=args.max_mismatches,
    )
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    serve(settings, host=args.host, port=args.port, port_file=args.port_file, log_level=str(level))
    return 0
