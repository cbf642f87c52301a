"""Bench output: a table for people, JSON for machines, a PNG chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = (
    ("engine", "engine", "{:>8}"),
    ("cp", "cp", "{:>3}"),
    ("alloc", "alloc", "{:>10}"),
    ("tokens", "tokens", "{:>7}"),
    ("MB", "bytes", "{:>9.1f}"),
    ("kvb slices", "kvbridge_slices", "{:>10}"),
    ("ideal", "ideal_slices", "{:>7}"),
    ("plan ms", "plan_ms", "{:>8.2f}"),
    ("kvb GB/s", "kvbridge_gbps", "{:>9.3f}"),
    ("staged GB/s", "staged_gbps", "{:>11.3f}"),
    ("stg slices", "staged_slices", "{:>10}"),
    ("raw GB/s", "raw_gbps", "{:>9.3f}"),
    ("engine GB/s", "engine_gbps", "{:>11.3f}"),
    ("memcpy GB/s", "memcpy_gbps", "{:>11.2f}"),
    ("kvb p50 ms", "kvbridge_p50_ms", "{:>10.1f}"),
    ("raw p50 ms", "raw_p50_ms", "{:>10.1f}"),
    ("kvb p99 ms", "kvbridge_p99_ms", "{:>10.1f}"),
    ("vs raw", "ratio_vs_raw", "{:>7.2f}"),
    ("stg/raw", "staged_vs_raw", "{:>7.2f}"),
    ("stg/contig", "staged_vs_contiguous", "{:>10.2f}"),
    ("vs memcpy", "ratio_vs_memcpy", "{:>9.3f}"),
    ("kvb load GB/s", "kvbridge_load_gbps", "{:>13.3f}"),
    ("load p50 ms", "kvbridge_load_room_p50_ms", "{:>11.1f}"),
    ("stg load GB/s", "staged_load_gbps", "{:>13.3f}"),
    ("stg load p50 ms", "staged_load_room_p50_ms", "{:>15.1f}"),
    ("kvb load busiest", "kvbridge_load_busiest", "{:>22}"),
    ("stg load busiest", "staged_load_busiest", "{:>22}"),
    ("ok", "ok", "{:>3}"),
)
LOAD_KEYS = {"kvbridge_load_gbps", "kvbridge_load_room_p50_ms", "staged_load_gbps", "staged_load_room_p50_ms",
             "kvbridge_load_busiest", "staged_load_busiest"}


def format_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    # the load columns only where rooms went several at once (``--rooms-in-flight``)
    columns = [c for c in COLUMNS if c[1] not in LOAD_KEYS or any(r.get("rooms_in_flight", 1) > 1 for r in rows)]
    widths = [max(len(title), len(fmt.format(_sample(key)))) for title, key, fmt in columns]
    header = " ".join(title.rjust(w) for (title, _, _), w in zip(columns, widths))
    lines = [_describe(meta), "", header]
    for row in rows:
        cells = []
        for (title, key, fmt), w in zip(columns, widths):
            value = row["bytes"] / 1e6 if key == "bytes" else row.get(key)
            if key == "ok":
                value = "yes" if not row["verify_errors"] and not row["kvbridge_failures"] else "NO"
            elif value is None:  # not measured for this row (the engine alone on Mooncake: raw is it)
                value, fmt = "-", "{}"
            cells.append(fmt.format(value).rjust(w))
        lines.append(" ".join(cells))
    for row in rows:
        for reason in row["verify_errors"] + row["kvbridge_failures"]:
            lines.append(f"cp={row['cp']} tokens={row['tokens']}: {reason}")
    for engine in dict.fromkeys(r.get("engine", "mooncake") for r in rows):
        ours = [r for r in rows if r.get("engine", "mooncake") == engine]
        goal = [r for r in ours if r["tokens"] >= 8192 and r.get("ratio_vs_raw")]
        if goal:
            worst = min(r["ratio_vs_raw"] for r in goal)
            ideal = all(r["kvbridge_slices"] == r["ideal_slices"] for r in ours)
            raw = "raw NIXL" if engine == "nixl" else "raw Mooncake"
            lines += [
                "",
                f"goal kvbridge on {engine} >= 0.9x {raw} for >= 8K tokens: worst {worst:.2f}x -> "
                f"{'met' if worst >= 0.9 else 'NOT met'}",
                "slices kvbridge posted per room == ideal (runs x layers x pools, + 1 when the aux row is "
                f"written): {'yes' if ideal else 'NO'}",
            ]
        staged_nixl = [r for r in ours if engine == "nixl" and r["tokens"] >= 8192 and r.get("staged_vs_raw")]
        if staged_nixl:
            worst = min(r["staged_vs_raw"] for r in staged_nixl)
            lines.append(f"goal staged on nixl >= 0.9x raw NIXL on the same slices for >= 8K tokens: worst "
                         f"{worst:.2f}x -> {'met' if worst >= 0.9 else 'NOT met'}")
    rows = [r for r in rows if r.get("engine", "mooncake") == "mooncake"]  # the staged goals below: Mooncake's
    staged = [r for r in rows if r["tokens"] >= 8192 and r["alloc"] == "random" and r.get("staged_gbps")]
    if staged:
        vs_contig = [r["staged_vs_contiguous"] for r in staged if r.get("staged_vs_contiguous")]
        vs_raw = [r["staged_vs_raw"] for r in staged if r.get("staged_vs_raw")]
        if vs_contig:
            lines.append(f"goal staged (random) >= 0.8x kvbridge contiguous for >= 8K tokens: worst "
                         f"{min(vs_contig):.2f}x -> {'met' if min(vs_contig) >= 0.8 else 'NOT met'}")
        if vs_raw:
            lines.append(f"goal staged (random) >= 2x raw Mooncake on the same slices for >= 8K tokens: worst "
                         f"{min(vs_raw):.2f}x -> {'met' if min(vs_raw) >= 2 else 'NOT met'}")
    return "\n".join(lines)


def _sample(key: str) -> Any:
    return {"ok": "yes", "alloc": "contiguous", "engine": "mooncake"}.get(key, 0)


def _describe(meta: dict[str, Any]) -> str:
    text = (
        f"kvbridge bench: {meta['preset']}, {meta['layers']} target + {meta['draft_layers']} draft layers, "
        f"page {meta['page_size']}, engine {meta['engine']}, {meta['reps']} rooms per method, every rank its "
        f"own process; allocation {'/'.join(meta.get('allocs', ['contiguous']))} (contiguous: decode pages "
        f"{meta.get('dst_order', 'logical')}; random: both sides from a shuffled free list); engine GB/s: "
        "the engine alone on the same slices where kvbridge's engine is not the one raw drives (on Mooncake "
        "raw GB/s is the engine alone: '-')"
    )
    if meta.get("ask_first"):
        text += ("\norder: decode asks first (an engine's order); kvbridge's time runs from the prefill ranks' "
                 "send() to decode seeing Success")
    if meta.get("rooms_in_flight", 1) > 1:
        text += (f"\nload: {meta['rooms_in_flight']} rooms at once, each on its own decode pages; decode asks for all, "
                 "then every prefill rank sends them from one instant; GB/s: their bytes over the time to the last "
                 "Success; p50 ms: each room's own, from that instant; busiest: the rank's thread of kvbridge's host "
                 "work (its loop, or commands: prefill's send()) with the most CPU time over that time (1.00: never "
                 "idle; every thread's, the engine's pump too, in --json)")
    if meta.get("note"):
        text += f"\nnote: {meta['note']}"
    return text


def write_json(path: str | Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


def write_plot(path: str | Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = (("kvbridge_gbps", "tab:blue", "kvbridge"), ("raw_gbps", "tab:orange", "raw Mooncake"),
               ("memcpy_gbps", "tab:green", "memcpy"))  # fmt: skip
    for i, cp in enumerate(sorted({r["cp"] for r in rows})):
        sub = sorted((r for r in rows if r["cp"] == cp), key=lambda r: r["tokens"])
        x = [r["tokens"] for r in sub]
        style = ("-", "--", ":", "-.")[i % 4]
        marker = "osd^"[i % 4]
        for key, color, label in methods:
            ax_bw.plot(x, [r[key] for r in sub], style, marker=marker, color=color, label=f"{label} cp={cp}")
        ax_ratio.plot(x, [r["ratio_vs_raw"] for r in sub], style, marker=marker, color="tab:blue", label=f"cp={cp}")
    ax_bw.set(xscale="log", yscale="log", xlabel="request tokens", ylabel="GB/s", title="throughput")
    ax_ratio.axhline(0.9, color="grey", linestyle="--", linewidth=1, label="goal 0.9x")
    ax_ratio.set(xscale="log", xlabel="request tokens", ylabel="kvbridge / raw Mooncake", title="ratio vs raw")
    for ax in (ax_bw, ax_ratio):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_describe(meta).split("\n")[0], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
