"""Entry point of the ``kvbridge`` console command."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import kvbridge.cli as cli_pkg
from kvbridge.errors import KVBridgeError
from kvbridge.log import LEVELS, configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="Move an LLM request's KV cache from prefill ranks to decode ranks.",
    )
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        type=str.upper,
        default=None,
        help="log level (default: $KVBRIDGE_LOG_LEVEL or INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(cli_pkg.__path__), key=lambda m: m.name):
        if info.name == "main" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"kvbridge.cli.{info.name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)
        return int(args.func(args) or 0)
    except KVBridgeError as exc:
        print(f"kvbridge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
