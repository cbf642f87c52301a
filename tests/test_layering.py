"""The import graph of kvbridge/: no circles (type-only imports included) and every arrow
points down the floors below. A module's floor is that of its top-level part:

    0  kvbridge._version, kvbridge.errors, kvbridge.log, kvbridge.settings
    1  kvbridge.layout                  pure geometry and planning
    2  kvbridge.bootstrap               contract, daemon, client
    3  kvbridge.transfer                engines, channel, rooms, endpoints
    4  kvbridge (the public API)
    5  kvbridge.integrations, kvbridge.doctor
    6  kvbridge.worker
    7  kvbridge.chaos, kvbridge.bench, kvbridge.demo, kvbridge.demo_model, kvbridge.demo_v4
    8  kvbridge.cli

Inside ``kvbridge.transfer`` (38% of the package) the same rule holds between its parts:

    0  channel, poll, actions, ownership, digest, checks     wire and plain records
    1  engine                                                 transfer engines (IPC rides the channel)
    2  staging, aux_rows, scratch, registration               memory both sides register and stage through
    3  rooms, shell                                           what both sides' rooms and shells share
    4  prefill | decode                                       one side each: never one importing the other
    5  kvbridge.transfer (its __init__)                       the package's face

Read from the source with ``ast`` (nothing is imported), so a lazy import inside a function
counts as much as one at the top: it is an arrow all the same. Imports are absolute (no
``from . import``), and no module takes another's private names, relative or not.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import kvbridge

ROOT = Path(kvbridge.__file__).parent
FLOORS = {
    "kvbridge._version": 0, "kvbridge.errors": 0, "kvbridge.log": 0, "kvbridge.settings": 0,
    "kvbridge.layout": 1,
    "kvbridge.bootstrap": 2,
    "kvbridge.transfer": 3,
    "kvbridge": 4,
    "kvbridge.integrations": 5, "kvbridge.doctor": 5,
    "kvbridge.worker": 6,
    "kvbridge.chaos": 7, "kvbridge.bench": 7, "kvbridge.demo": 7, "kvbridge.demo_model": 7,
    "kvbridge.demo_v4": 7,
    "kvbridge.cli": 8,
}


TRANSFER_FLOORS = {
    "channel": 0, "poll": 0, "actions": 0, "ownership": 0, "digest": 0, "checks": 0, "binding": 0,
    "engine": 1,
    "staging": 2, "aux_rows": 2, "scratch": 2, "registration": 2,
    "rooms": 3, "shell": 3,
    "prefill": 4, "decode": 4,
    "": 5,
}
SIDES = ("prefill", "decode")  # one floor, and neither imports the other


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("kvbridge", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@functools.cache
def _nodes(path: Path) -> list[ast.AST]:
    """Every node of one module's syntax tree (parsed once for all the checks below)."""
    return list(ast.walk(ast.parse(path.read_text())))


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    modules = _modules()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _nodes(path):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                # ``from package import submodule`` is an arrow to the submodule, not to the package
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("kvbridge"):
                    found = resolve(target)
                    if found and found != name:
                        edges[name].add(found)
    return {name: frozenset(edges.get(name, ())) for name in modules}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _floor(module: str) -> int:
    while module not in FLOORS:
        module = module.rpartition(".")[0]
    return FLOORS[module]


def test_there_are_no_import_circles():
    assert _circles(_graph()) == []


def test_every_arrow_points_down():
    up = sorted(f"{a} -> {b}" for a, targets in _graph().items() for b in targets
                if _floor(b) > _floor(a))
    assert up == []


def _private_imports() -> list[str]:
    """``from kvbridge.x import _name`` (or ``from .x import _name``) where ``_name`` is not a
    module: one module reaching into another's private names (a resource cut in two, STYLE.md
    point 6)."""
    modules = _modules()
    out = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _nodes(path):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if not base.startswith("kvbridge"):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{base}.{alias.name}" not in modules:
                    out.append(f"{name} takes {alias.name} from {base}")
    return sorted(out)


def _relative_imports() -> list[str]:
    out = []
    for name, path in _modules().items():
        for node in _nodes(path):
            if isinstance(node, ast.ImportFrom) and node.level:
                out.append(f"{name}: from {'.' * node.level}{node.module or ''} import ...")
    return sorted(out)


def test_imports_are_absolute():
    assert _relative_imports() == []


def _transfer_part(module: str) -> str | None:
    """``kvbridge.transfer.prefill.machine`` -> ``prefill``; the package itself -> ``""``."""
    if module != "kvbridge.transfer" and not module.startswith("kvbridge.transfer."):
        return None
    return module[len("kvbridge.transfer."):].split(".")[0] if module != "kvbridge.transfer" else ""


def _transfer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Arrows inside ``kvbridge.transfer`` that point up its floors, or between the two sides; a
    part with no floor is named too (place it in TRANSFER_FLOORS)."""
    out = []
    for a, targets in edges.items():
        pa = _transfer_part(a)
        if pa is None:
            continue
        if pa not in TRANSFER_FLOORS:
            out.append(f"{a}: transfer part {pa!r} has no floor")
            continue
        for b in targets:
            pb = _transfer_part(b)
            if pb is None or pb == pa:
                continue
            if pb not in TRANSFER_FLOORS:
                out.append(f"{b}: transfer part {pb!r} has no floor")
            elif pa in SIDES and pb in SIDES:
                out.append(f"{a} -> {b}: one side imports the other")
            elif TRANSFER_FLOORS[pb] > TRANSFER_FLOORS[pa]:
                out.append(f"{a} -> {b}: up from floor {TRANSFER_FLOORS[pa]} to {TRANSFER_FLOORS[pb]}")
    return sorted(set(out))


def test_inside_transfer_every_arrow_points_down_and_the_sides_never_meet():
    assert _transfer_violations(_graph()) == []


def test_the_transfer_checker_sees_each_kind_of_violation():
    """The check above can fail: an arrow up (channel -> prefill, engine -> decode), the two sides
    meeting (prefill -> decode, decode -> prefill), and a part without a floor."""
    edges = {
        "kvbridge.transfer.channel.wire": {"kvbridge.transfer.prefill.machine"},
        "kvbridge.transfer.engine.base": {"kvbridge.transfer.decode.room"},
        "kvbridge.transfer.prefill.machine": {"kvbridge.transfer.decode.machine", "kvbridge.transfer.rooms"},
        "kvbridge.transfer.decode.machine": {"kvbridge.transfer.prefill.targets"},
        "kvbridge.transfer.newpart": set(),
    }
    assert _transfer_violations(edges) == [
        "kvbridge.transfer.channel.wire -> kvbridge.transfer.prefill.machine: up from floor 0 to 4",
        "kvbridge.transfer.decode.machine -> kvbridge.transfer.prefill.targets: one side imports the other",
        "kvbridge.transfer.engine.base -> kvbridge.transfer.decode.room: up from floor 1 to 4",
        "kvbridge.transfer.newpart: transfer part 'newpart' has no floor",
        "kvbridge.transfer.prefill.machine -> kvbridge.transfer.decode.machine: one side imports the other",
    ]


def test_no_module_takes_another_modules_private_names():
    assert _private_imports() == []


def test_the_checker_sees_a_circle_and_an_arrow_up():
    """The checks above can fail: a made-up graph with one circle and one arrow up."""
    edges = {"kvbridge.layout.a": {"kvbridge.layout.b"}, "kvbridge.layout.b": {"kvbridge.layout.a"},
             "kvbridge.layout.c": {"kvbridge.transfer"}, "kvbridge.transfer": set()}
    assert _circles(edges) == [["kvbridge.layout.a", "kvbridge.layout.b"]]
    assert _floor("kvbridge.layout.c") < _floor("kvbridge.transfer")


def test_staging_is_one_package_below_both_sides():
    """Staging's slot table, stagers, buffer and settings live in ``kvbridge.transfer.staging``:
    both sides' rooms import them from there, nothing of staging sits among the engines, and the
    package imports neither side (it is below both)."""
    graph = _graph()
    staging = {m for m in graph if m == "kvbridge.transfer.staging" or m.startswith("kvbridge.transfer.staging.")}
    assert {"kvbridge.transfer.staging.area", "kvbridge.transfer.staging.stagers"} <= staging
    assert [m for m in graph if m.startswith("kvbridge.transfer.engine.") and "stag" in m] == []
    sides = ("kvbridge.transfer.prefill", "kvbridge.transfer.decode")
    assert sorted(f"{a} -> {b}" for a in staging for b in graph[a] if b.startswith(sides)) == []
    for side in sides:
        users = {a for a, targets in graph.items() if a.startswith(side) and targets & staging}
        assert users, f"no module of {side} uses the staging package"
