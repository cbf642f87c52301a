"""``kvbridge version``: the package and wire-protocol versions."""

from __future__ import annotations

import argparse

import kvbridge


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("version", help="print kvbridge's version", description="Print kvbridge's version.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(f"kvbridge {kvbridge.__version__} (wire protocol {kvbridge.WIRE_VERSION})")
    return 0
