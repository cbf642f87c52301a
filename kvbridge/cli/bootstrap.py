"""``kvbridge bootstrap``: run the bootstrap daemon (rank registry, contract
fingerprints, prefill-topology lookups, diagnostics)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TOKEN_ENV = "KVBRIDGE_BOOTSTRAP_TOKEN"
READ_TOKEN_ENV = "KVBRIDGE_READ_TOKEN"
ADMIN_TOKEN_ENV = "KVBRIDGE_ADMIN_TOKEN"
# (flag stem, environment variable, what it grants)
TOKENS = (
    ("token", TOKEN_ENV, "bearer token required on every write (none: writes are open)"),
    ("read-token", READ_TOKEN_ENV, "bearer token required to read /v1/instances, /v1/ranks/{id}, /v1/diagnostics/* "
     "and /diagnostics; the write and admin tokens read too (reads need one of the three whenever any token is set; "
     "no token at all: reads are open)"),
    ("admin-token", ADMIN_TOKEN_ENV, "operators' bearer token: reads, writes, and renews, replaces or deregisters any "
     "rank without its lease secret (none: only a rank's own lease secret can)"),
)

# The store: flag > KVBRIDGE_<NAME> environment variable > [bootstrap] table of --config > default.
# (name, default, help); the flag is --<name with dashes>, the TOML key <name>.
STORE_SETTINGS: tuple[tuple[str, Any, str], ...] = (
    ("store", "memory", "where the registry lives: 'memory' (this process only) or etcd://h1:2379,h2:2379,h3:2379 "
     "(etcds:// for TLS); with etcd any number of daemons serve one cluster"),
    ("etcd_ca_cert", None, "CA bundle that signs the etcd members' certificates (etcds://)"),
    ("etcd_cert", None, "client certificate for etcd (mutual TLS; with --etcd-key)"),
    ("etcd_key", None, "client certificate key for etcd"),
    ("etcd_user", None, "etcd user (role-based auth; with --etcd-password or its file)"),
    ("etcd_password_file", None, "file holding the etcd user's password (KVBRIDGE_ETCD_PASSWORD also works)"),
    ("etcd_prefix", "/kvbridge/", "key prefix in etcd (one prefix per kvbridge cluster)"),
    ("etcd_timeout", 2.0, "seconds one etcd request may take before the next member is tried"),
    ("replica_name", "", "this daemon's name among replicas, in X-KVBridge-Replica and /diagnostics (empty: host:port)"),
)
ETCD_PASSWORD_ENV = "KVBRIDGE_ETCD_PASSWORD"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bootstrap",
        help="run the bootstrap daemon",
        description=(
            "Run the bootstrap daemon: ranks register with a lease, decode ranks look up the prefill "
            "topology of a request, contract fingerprints are compared (409 with a field diff on mismatch). "
            "Each registration returns a lease secret that its heartbeats, deregistration and re-registration "
            "must present. Diagnostics at /diagnostics, metrics at /metrics, OpenAPI at /docs."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8998, help="port to listen on; 0 picks a free one (default: 8998)")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port to this file once listening")
    for stem, env, text in TOKENS:
        p.add_argument(f"--{stem}", default=None, help=f"{text} (default: ${env})")
        p.add_argument(f"--{stem}-file", type=Path, default=None, help=f"read --{stem} from this file (keeps it out of ps)")
    p.add_argument("--endpoints", choices=("auto", "local", "network"), default="auto",
                   help="hosts a registration's session and control endpoint may name: local (every rank on this "
                        "host: loopback only, each spelling of it made 127.0.0.1), network (loopback and 0.0.0.0 "
                        "refused; names resolved to one address), auto: local when --host is loopback, else "
                        "network (default: auto)")
    p.add_argument("--lease-ttl", type=float, default=10.0, help="lease in seconds for ranks that ask for none (default: 10)")
    p.add_argument("--max-lease-ttl", type=float, default=300.0, help="longest lease a rank may ask for (default: 300)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default: 1 MiB)")
    p.add_argument("--max-mismatches", type=int, default=100, help="refusals kept for diagnostics (default: 100)")
    p.add_argument("--max-ranks-per-instance", type=int, default=1024,
                   help="largest instance (dp x cp x tp x pp ranks) that may register (default: 1024)")
    p.add_argument("--max-instances", type=int, default=1024, help="instances registered at once (default: 1024)")
    p.add_argument("--max-ranks", type=int, default=8192,
                   help="ranks registered at once, every instance together; more get 429 (default: 8192)")
    p.add_argument("--max-metadata-chars", type=int, default=64 << 20,
                   help="engine_metadata characters (NIXL agents' metadata, base64) all registered ranks hold "
                        "together; a registration over it gets 429 (default: 67108864)")
    p.add_argument("--claim-grace-s", type=float, default=30.0,
                   help="how long a rank's claim on its transport session outlives its lease, for its own proof "
                        "key only (default: 30)")
    p.add_argument("--claims-file", type=Path, default=None,
                   help="in-memory store: keep every claim in this file too, and read them back at start, so a "
                        "restarted daemon holds each for its owner (default: none; etcd keeps them itself)")
    p.add_argument("--max-lookups-per-s", type=float, default=1000.0,
                   help="handshakes (room look-ups) per second per decode instance, bursts of twice that; "
                   "more get 429 with Retry-After; 0: unlimited (default: 1000)")
    p.add_argument("--max-requests-per-s-per-address", type=float, default=2000.0,
                   help="look-ups and /v1 reads per second per client address, bursts of twice that (a client "
                   "that names a new decode instance per look-up still meets it); more get 429 "
                   "too_many_requests with Retry-After; 0: unlimited (default: 2000)")
    for name, default, text in STORE_SETTINGS:
        p.add_argument(f"--{name.replace('_', '-')}", default=None, help=f"{text} (default: {default!r}; env "
                       f"KVBRIDGE_{name.upper()}; key {name} of --config's [bootstrap] table)")
    p.add_argument("--config", type=Path, default=None,
                   help="TOML file whose [bootstrap] table sets the store options above (default: $KVBRIDGE_CONFIG)")
    p.set_defaults(func=run)


def _read_toml(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        table = tomllib.loads(path.read_text()).get("bootstrap", {})
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc.strerror}", field="config") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {str(path)!r} is not TOML: {exc}", field="config") from exc
    known = {n for n, _, _ in STORE_SETTINGS}
    table = {k.replace("-", "_"): v for k, v in table.items()}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"config {str(path)!r}: unknown key(s) {unknown} in [bootstrap] (known: {sorted(known)})",
                          field=unknown[0])
    return table


def store_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The store options by precedence: flag > environment > TOML > default."""
    config = args.config or (Path(os.environ["KVBRIDGE_CONFIG"]) if os.environ.get("KVBRIDGE_CONFIG") else None)
    toml = _read_toml(config)
    out: dict[str, Any] = {}
    for name, default, _ in STORE_SETTINGS:
        value = getattr(args, name)
        if value is None:
            value = os.environ.get(f"KVBRIDGE_{name.upper()}") or None
        if value is None:
            value = toml.get(name, default)
        out[name] = value
    try:
        out["etcd_timeout"] = float(out["etcd_timeout"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"etcd timeout {out['etcd_timeout']!r} is not a number of seconds", field="etcd_timeout") from exc
    return out


def etcd_options(opts: dict[str, Any]) -> Any:
    """``EtcdOptions`` for an etcd store URL, None for the in-memory store."""
    from kvbridge.bootstrap.store import EtcdOptions, parse_store_url

    kind, endpoints, tls = parse_store_url(str(opts["store"]))
    if kind == "memory":
        return None
    password = os.environ.get(ETCD_PASSWORD_ENV) or None
    if opts["etcd_password_file"]:
        try:
            password = Path(opts["etcd_password_file"]).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read etcd password file: {exc.strerror}", field="etcd_password_file") from exc
    return EtcdOptions(endpoints=endpoints, tls=tls or bool(opts["etcd_ca_cert"]), ca_cert=opts["etcd_ca_cert"],
                       cert=opts["etcd_cert"], key=opts["etcd_key"], user=opts["etcd_user"], password=password,
                       prefix=str(opts["etcd_prefix"]), timeout_s=opts["etcd_timeout"])


def _token(args: argparse.Namespace, stem: str, env: str) -> str | None:
    name = stem.replace("-", "_")
    value, path = getattr(args, name), getattr(args, f"{name}_file")
    if value is not None and path is not None:
        raise ConfigError(f"give --{stem} or --{stem}-file, not both", field=name)
    if path is not None:
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read {stem} file {str(path)!r}: {exc.strerror}", field=f"{name}_file") from exc
        if not token:
            raise ConfigError(f"{stem} file {str(path)!r} is empty", field=f"{name}_file")
        return token
    return value if value is not None else (os.environ.get(env) or None)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `kvbridge --help` does not pay for FastAPI.
    from kvbridge.bootstrap.app import BootstrapSettings
    from kvbridge.bootstrap.server import serve

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"port {args.port} is outside 0..65535", field="port")
    tokens = {stem.replace("-", "_"): _token(args, stem, env) for stem, env, _ in TOKENS}
    store = store_settings(args)
    settings = BootstrapSettings(
        etcd=etcd_options(store),
        replica=str(store["replica_name"]),
        **tokens,
        lease_ttl_s=args.lease_ttl,
        max_lease_ttl_s=args.max_lease_ttl,
        max_body_bytes=args.max_body_bytes,
        max_mismatches=args.max_mismatches,
        max_ranks_per_instance=args.max_ranks_per_instance,
        max_instances=args.max_instances,
        max_lookups_per_s=args.max_lookups_per_s,
        max_requests_per_s_per_address=args.max_requests_per_s_per_address,
        endpoints=args.endpoints,
        claim_grace_s=args.claim_grace_s,
        claims_file=str(args.claims_file) if args.claims_file is not None else None,
        max_ranks=args.max_ranks,
        max_metadata_chars=args.max_metadata_chars,
    )
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    serve(settings, host=args.host, port=args.port, port_file=args.port_file, log_level=str(level))
    return 0
