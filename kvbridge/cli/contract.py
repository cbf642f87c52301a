"""``kvbridge contract``: show a runtime contract, fingerprint one, diff two.

    kvbridge contract show [--preset NAME] [--layers N] [--page-size N] [--draft-layers N] [--json]
    kvbridge contract fingerprint FILE          (FILE or - for stdin; prints the fingerprint)
    kvbridge contract diff A.json B.json [--json]   exit 0 equal, 1 different, 2 unreadable
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.errors import ConfigError
from kvbridge.layout.lanes import LANE_RULES
from kvbridge.layout.hybrid import KIND_PRESETS
from kvbridge.layout.pools import PRESETS

if TYPE_CHECKING:
    from kvbridge.bootstrap.contract import RuntimeContract


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "contract",
        help="show, fingerprint or diff runtime contracts",
        description="Show a runtime contract, print the fingerprint of one, or list the fields where two differ.",
    )
    csub = p.add_subparsers(dest="contract_command", metavar="ACTION", required=True)

    show = csub.add_parser("show", help="print a preset's contract and fingerprint", description="Print a preset's runtime contract and its fingerprint.")
    show.add_argument("--preset", choices=PRESETS + KIND_PRESETS, default="deepseek-v3.2",
                      help="model preset (default: deepseek-v3.2)")
    show.add_argument("--layers", type=int, default=None, help="target layers (default: 61; deepseek-v4: 43)")
    show.add_argument("--page-size", type=int, default=64, help="tokens per page (default: 64)")
    show.add_argument("--draft-layers", type=int, default=1, help="NextN/EAGLE draft layers; 0 disables speculation (default: 1)")
    show.add_argument("--cp-rule", choices=LANE_RULES, default="interleaved", help="CP owner-lane rule")
    show.add_argument("--revision", default="unspecified", help="weights revision or digest")
    show.add_argument("--json", action="store_true", help="print the contract as JSON (input for fingerprint and diff)")
    show.set_defaults(func=run_show)

    fp = csub.add_parser("fingerprint", help="print the fingerprint of a contract file", description="Print the fingerprint of a contract JSON file.")
    fp.add_argument("file", help="contract JSON (as `contract show --json` writes it), or - for stdin")
    fp.set_defaults(func=run_fingerprint)

    diff = csub.add_parser(
        "diff",
        help="list the fields where two contracts differ",
        description="List the fields where two contracts differ, with both values and what each difference breaks. "
        "Exit status: 0 equal, 1 different, 2 a file cannot be read.",
    )
    diff.add_argument("prefill", help="the prefill side's contract JSON")
    diff.add_argument("decode", help="the decode side's contract JSON")
    diff.add_argument("--json", action="store_true", help="print the differences as a JSON list")
    diff.set_defaults(func=run_diff)


def _load(name: str) -> RuntimeContract:
    from pydantic import ValidationError

    from kvbridge.bootstrap.contract import RuntimeContract

    try:
        text = sys.stdin.read() if name == "-" else Path(name).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read contract {name!r}: {exc.strerror}", field="file") from exc
    try:
        return RuntimeContract.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"contract {name!r} is not JSON: {exc.msg} at line {exc.lineno}", field="file") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "contract"
        raise ConfigError(f"contract {name!r} is not a runtime contract: {where}: {first['msg']}", field=where) from exc


def run_show(args: argparse.Namespace) -> int:
    from kvbridge.bootstrap.contract import contract_from_preset, fingerprint

    c = contract_from_preset(
        args.preset, num_layers=args.layers, page_size=args.page_size, draft_layers=args.draft_layers,
        cp_rule=args.cp_rule, revision=args.revision,
    )
    if args.json:
        print(json.dumps(c.model_dump(mode="json"), indent=2, sort_keys=True))
        return 0
    print(f"fingerprint   {fingerprint(c)}")
    print(f"wire version  {c.wire_version}")
    print(f"model         {c.model.name} @ {c.model.revision}: {c.model.target_layers} target + {c.model.draft_layers} draft layers")
    print(f"cp rule       {c.cp_rule}")
    print(f"kernel        {c.kernel.attention_backend} ({c.kernel.abi})")
    s = c.speculative
    print(f"speculative   {s.algorithm}" + (f", hidden {s.hidden_size} x {s.hidden_dtype}, top-{s.topk}" if s.algorithm != "none" else ""))
    print(f"aux row       {c.aux.row_bytes} B: " + ", ".join(f"{f.name}:{f.dtype}{f.shape or ''}" for f in c.aux.regions))
    print("pools")
    for p in c.pools:
        split = f" ({p.value_bytes_per_token}+{p.scale_bytes_per_token})" if p.layout == "values_then_scales" else ""
        kind = {"paged": "", "window": f", window {p.window}" + (f" ring {p.ring_stride}" if p.ring_stride else ""),
                "compressed": f", compressed 1:{p.ratio}",
                "state": ", state slot" + (f" (tail of {p.ratio})" if p.ratio else "")
                + (f", TP groups {p.shard_units} x {p.unit_bytes} B" if p.shard_units else "")}[p.kind]
        padded = f" padded to {p.page_stride}" if p.page_stride else ""
        print(f"  {p.name:<14} {p.dtype:<20} abi={p.abi:<9} {p.bytes_per_token} B/token{split} x {p.page_size} = "
              f"{p.bytes_per_token * p.page_size}{padded} B/page, {p.layout}{kind}, kernel {p.kernel_abi}, "
              f"layers {p.layer_ids[0]}..{p.layer_ids[-1]}")
    print(f"source        {c.source.digest[:16]} over {len(c.source.files)} file(s)")
    for name, h in c.source.files.items():
        print(f"  {name}  {h[:16]}")
    return 0


def run_fingerprint(args: argparse.Namespace) -> int:
    from kvbridge.bootstrap.contract import fingerprint

    print(fingerprint(_load(args.file)))
    return 0


def run_diff(args: argparse.Namespace) -> int:
    from kvbridge.bootstrap.diff import diff_contracts

    diffs = diff_contracts(_load(args.prefill), _load(args.decode))
    if args.json:
        print(json.dumps([d.model_dump(mode="json") for d in diffs], indent=2))
    elif not diffs:
        print("contracts are equal")
    else:
        print(f"{len(diffs)} field(s) differ:")
        for d in diffs:
            print(f"  {d.path}\n    prefill: {json.dumps(d.prefill)}\n    decode:  {json.dumps(d.decode)}\n    breaks:  {d.breaks}")
    return 1 if diffs else 0
