"""``kvbridge doctor``: check every hop a room needs, from this host, and say what to fix."""

from __future__ import annotations

import argparse
import json
import os

from kvbridge.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check every hop a room between two instances needs, from this host",
        description="Check, from the host it runs on, every hop a room needs: the bootstrap daemon answers and "
        "accepts the token (reads and writes), clocks agree, both instances are registered with every rank, "
        "their contracts are equal (else the field diff), leases are fresh, each prefill rank's control "
        "endpoint answers a Ping authenticated with the cluster secret, and each rank's transfer-engine "
        "session takes a probe write into its scratch region and returns it (never a KV page). Prints a "
        "table (or --json) and exits 1 when any hop fails. Run it on a prefill host to check the "
        "prefill -> decode direction rooms use.",
    )
    p.add_argument("--bootstrap", default=None,
                   help="bootstrap daemon URL (default: $KVBRIDGE_BOOTSTRAP or http://127.0.0.1:8998)")
    p.add_argument("--prefill", required=True, metavar="INSTANCE", help="the prefill instance")
    p.add_argument("--decode", required=True, metavar="INSTANCE", help="the decode instance")
    p.add_argument("--token", default=None, help="bootstrap token (default: $KVBRIDGE_BOOTSTRAP_TOKEN or $KVBRIDGE_TOKEN)")
    p.add_argument("--secret", default=None, help="cluster secret of the control channel (default: $KVBRIDGE_SECRET)")
    p.add_argument("--host", default="127.0.0.1", help="address of doctor's own transfer engine (default: 127.0.0.1)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per probe (default: 3)")
    p.add_argument("--max-clock-skew", type=float, default=2.0, help="largest clock difference accepted, s (default: 2)")
    p.add_argument("--no-engine", action="store_true", help="do not probe transfer-engine sessions (no Mooncake here)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.doctor import DoctorSpec, format_table, run_doctor

    if args.timeout <= 0 or args.max_clock_skew <= 0:
        raise ConfigError("--timeout and --max-clock-skew must be positive", field="timeout")
    url = args.bootstrap or os.environ.get("KVBRIDGE_BOOTSTRAP") or "http://127.0.0.1:8998"
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"bootstrap URL {url!r} must start with http:// or https://", field="bootstrap")
    token = args.token or os.environ.get("KVBRIDGE_BOOTSTRAP_TOKEN") or os.environ.get("KVBRIDGE_TOKEN") or None
    secret = args.secret if args.secret is not None else os.environ.get("KVBRIDGE_SECRET", "")
    spec = DoctorSpec(bootstrap=url.rstrip("/"), prefill=args.prefill, decode=args.decode, token=token,
                      secret=secret.encode() or None, host=args.host, timeout=args.timeout,
                      max_skew_s=args.max_clock_skew, engine=not args.no_engine)
    report = run_doctor(spec)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_table(report))
    return 0 if report.ok else 1
