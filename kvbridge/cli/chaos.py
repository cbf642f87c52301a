"""``kvbridge chaos``: inject faults into a local cluster under traffic and report what happened."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from kvbridge.chaos.names import FAULTS, STORE_FAULTS

    p = sub.add_parser(
        "chaos",
        help="inject faults into a local cluster under traffic; exit 1 if any misbehaves",
        description="Start a bootstrap daemon, a CP=2 prefill instance and a decode rank on 127.0.0.1 with traffic, "
        "and inject each fault in turn: SIGKILL, SIGSTOP (longer than a lease) and SIGTERM of a prefill rank, the "
        "decode rank and the daemon, and transfer-engine errors. Released decode pages are poisoned and checked "
        "before reuse. Reports per fault: rooms affected, seconds until they were Failed, whether every reason "
        "names the process at fault, rooms served after recovery, late writes, fds/threads/RSS before and after. "
        "Exits 1 when a fault misbehaves (a late write, a room that never ends, no recovery, a reason that does "
        "not name the process), or when no fault hit a write in flight.",
    )
    p.add_argument("--quick", action="store_true", help="smaller rooms and fewer of them (the test suite runs this)")
    p.add_argument("--faults", default=None, help=f"comma-separated subset of: {', '.join(FAULTS)} (default: all); "
                   f"also, by name only: {', '.join(STORE_FAULTS)} (three daemon replicas on a local etcd)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per room (default: 16384; quick 8192)")
    p.add_argument("--workdir", default=None, help="keep the processes' logs in this directory")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    from kvbridge.transfer.engine.registry import engine_names

    p.add_argument("--engine", choices=engine_names("network"), default="mooncake",
                   help="the workers' transfer engine (default %(default)s; nixl: kvbridge[nixl])")
    p.add_argument("--hostile", action="store_true",
                   help="run attacks instead of faults (aliasing, pre-auth flood, slow connection, slot exhaustion, "
                   "room collision, read exposure, Hello replay, post-auth partial frames, MAC-failing flood, "
                   "session spellings, a Mooncake-reading attacker, forged NIXL metadata, a metadata flood at the "
                   "daemon, a lapsed lease squatted, one identity's frame flood, an address flood against a TP 2 "
                   "host, held bytes while a connection proves itself, a daemon-restart race, two decode instances "
                   "racing for one room: see "
                   "docs/security.md) over --engine; exit 1 if any is not defended (an attack that cannot apply "
                   "to the engine is reported not applicable, with why); --quick runs every attack with fewer trials (but the race: "
                   "split_collision runs in full runs or by name)")
    p.add_argument("--attacks", default=None, help="with --hostile: comma-separated subset of: aliasing, "
                   "preauth_flood, slow_connection, slot_exhaustion, room_collision, read_exposure, hello_replay, "
                   "postauth_partial, mac_flood, spellings, mooncake_reader, bound_rooms, room_signatures, "
                   "nixl_metadata, metadata_flood, lease_squat, starvation, address_flood, proving_bytes, "
                   "restart_race, split_collision")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.chaos import ChaosSpec, format_report, run_chaos
    from kvbridge.errors import ConfigError
    from kvbridge.worker.runtime import quiet_http_logs

    quiet_http_logs()
    os.environ.setdefault("GLOG_minloglevel", "2")
    if args.hostile and (args.faults or args.tokens is not None):
        raise ConfigError("--faults and --tokens are for fault runs; with --hostile pick attacks with --attacks",
                          field="hostile")
    if args.attacks and not args.hostile:
        raise ConfigError("--attacks needs --hostile", field="attacks")
    if args.hostile:
        return run_hostile_cli(args)
    kw: dict = {}
    if args.faults:
        kw["faults"] = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    if args.tokens is not None:
        if args.tokens < 64:
            raise ConfigError("--tokens must be >= 64", field="tokens")
        kw["tokens"] = args.tokens
    if args.workdir:
        kw["workdir"] = args.workdir
    kw["engine"] = args.engine
    spec = ChaosSpec.quick(**kw) if args.quick else ChaosSpec(**kw)

    def progress(res) -> None:
        print(f"chaos: {res.fault}: {'ok' if res.ok else 'MISBEHAVED'} ({res.seconds}s)", file=sys.stderr, flush=True)

    report = run_chaos(spec, progress)
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["ok"] else 1


def run_hostile_cli(args: argparse.Namespace) -> int:
    from kvbridge.chaos.hostile import HostileSpec, format_hostile, run_hostile

    kw: dict = {"workdir": args.workdir} if args.workdir else {}
    kw["engine"] = args.engine
    if args.attacks:
        kw["attacks"] = tuple(a.strip() for a in args.attacks.split(",") if a.strip())
    spec = HostileSpec.quick(**kw) if args.quick else HostileSpec(**kw)

    def progress(out) -> None:
        print(f"chaos --hostile: {out.attack}: {out.outcome} ({out.seconds}s)", file=sys.stderr, flush=True)

    report = run_hostile(spec, progress)
    print(json.dumps(report) if args.json else format_hostile(report))
    return 0 if report["ok"] else 1
