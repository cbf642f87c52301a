"""``GET /diagnostics``: the fingerprints and recent refusals for a person.

Server-rendered, every value escaped, one inline style sheet, no scripts and no
external assets (the page must work on an air-gapped cluster). Each differing
field is a ``<tr class="diff-row" data-path="...">`` with both values marked.
"""

from __future__ import annotations

import json
import time
from html import escape
from typing import Any

from kvbridge.bootstrap.schemas import InstanceFingerprint, InstanceView, MismatchRecord

__all__ = ["render_diagnostics"]

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1b1b1b; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0 1em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
code, .fp { font-family: ui-monospace, monospace; font-size: 12.5px; }
tr.diff-row td { background: #fff1f0; }
tr.diff-row td.path { font-weight: 600; color: #a8071a; }
mark.left { background: #ffd8bf; } mark.right { background: #d6e4ff; }
.ok { color: #237804; } .bad { color: #a8071a; } .muted { color: #777; }
section.mismatch { border-left: 4px solid #cf1322; padding-left: .8em; margin-bottom: 1.5em; }
pre { background: #fafafa; border: 1px solid #eee; padding: .5em; max-height: 30em; overflow: auto; }
"""


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _value(value: Any) -> str:
    if value is None:
        return "(absent)"
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 400 else text[:397] + "..."


def _instances_table(instances: list[InstanceView]) -> str:
    if not instances:
        return '<p class="muted">No instance is registered.</p>'
    rows = []
    for inst in instances:
        state = '<span class="ok">complete</span>' if inst.complete else '<span class="bad">incomplete</span>'
        rows.append(
            f'<tr data-instance="{_e(inst.name)}"><td>{_e(inst.name)}</td><td>{_e(inst.role)}</td>'
            f'<td class="fp">{_e(inst.fingerprint)}</td><td>{_e(inst.topology.shape)}</td>'
            f"<td>{inst.num_ranks} / {inst.expected_ranks}</td><td>{state}</td></tr>"
        )
    head = "<tr><th>instance</th><th>role</th><th>fingerprint</th><th>shape</th><th>ranks</th><th>senders</th></tr>"
    return f'<table id="instances">{head}{"".join(rows)}</table>'


def _mismatch(i: int, m: MismatchRecord) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.time)) + "Z"
    left, right = m.left, m.right
    rows = "".join(
        f'<tr class="diff-row" data-path="{_e(d.path)}"><td class="path"><code>{_e(d.path)}</code></td>'
        f'<td><mark class="left">{_e(_value(d.prefill))}</mark></td>'
        f'<td><mark class="right">{_e(_value(d.decode))}</mark></td><td>{_e(d.breaks)}</td></tr>'
        for d in m.diff
    )
    head = f"<tr><th>field</th><th>{_e(left.label)}</th><th>{_e(right.label)}</th><th>what it breaks</th></tr>"
    return (
        f'<section class="mismatch" id="mismatch-{i}" data-kind="{_e(m.kind)}" data-reason="{_e(m.reason)}">'
        f"<h3>{_e(when)} &middot; {_e(m.kind)} refused ({_e(m.reason)})</h3>"
        f"<p>{_e(left.label)}: <b>{_e(left.rank)}</b> <span class=\"fp\">{_e(left.fingerprint)}</span><br>"
        f"{_e(right.label)}: <b>{_e(right.rank)}</b> <span class=\"fp\">{_e(right.fingerprint)}</span></p>"
        f"<p>{_e(m.message)}</p><table class=\"diff\">{head}{rows}</table></section>"
    )


def _contracts(fingerprints: list[InstanceFingerprint]) -> str:
    parts = []
    for f in fingerprints:
        body = json.dumps(f.contract.model_dump(mode="json"), indent=2, sort_keys=True)
        parts.append(
            f'<details data-instance="{_e(f.instance)}"><summary>{_e(f.instance)} ({_e(f.role)}) '
            f'<span class="fp">{_e(f.fingerprint)}</span>, {len(f.ranks)} rank(s)</summary><pre>{_e(body)}</pre></details>'
        )
    return "".join(parts) or '<p class="muted">None.</p>'


def _store(store: dict[str, Any] | None) -> str:
    """The store's health and the replicas it knows (any replica shows the same)."""
    if not store:
        return ""
    state = "available" if store.get("ok") else f"UNAVAILABLE: {store.get('cause', '')}"
    rows = "".join(
        f'<tr class="replica" data-replica="{_e(r["name"])}"><td>{_e(r["name"])}</td><td>{_e(r["url"])}</td>'
        f'<td>{r["seen_s_ago"]:.1f}s ago</td></tr>' for r in store.get("replicas", [])
    )
    table = (f"<table><tr><th>replica</th><th>url</th><th>last seen</th></tr>{rows}</table>" if rows else "")
    answered = f" &middot; answered by <b>{_e(str(store.get('answered_by', '')))}</b>" if store.get("answered_by") else ""
    return (f'<h2>Store</h2><p id="store" data-ok="{str(bool(store.get("ok"))).lower()}">{_e(str(store.get("kind")))} '
            f'store: <b>{_e(state)}</b>{answered}<br><span class="muted">{_e(", ".join(store.get("endpoints", [])))}'
            f'</span></p>{table}')


def render_diagnostics(
    instances: list[InstanceView], fingerprints: list[InstanceFingerprint], mismatches: list[MismatchRecord],
    store: dict[str, Any] | None = None,
) -> str:
    body = [
        "<h1>kvbridge bootstrap: diagnostics</h1>",
        _store(store),
        "<h2>Instances and fingerprints</h2>",
        _instances_table(instances),
        f"<h2>Recent refusals ({len(mismatches)})</h2>",
        "".join(_mismatch(i, m) for i, m in enumerate(mismatches)) or '<p class="muted">No refusal recorded.</p>',
        "<h2>Contracts</h2>",
        _contracts(fingerprints),
        '<p class="muted">JSON: <code>/v1/diagnostics/fingerprints</code>, <code>/v1/diagnostics/mismatches</code>.</p>',
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<title>kvbridge diagnostics</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>"
    )
