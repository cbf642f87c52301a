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

Read from the source with ``ast`` (nothing is imported), so a lazy import inside a function
counts as much as one at the top: it is an arrow all the same.
"""

from __future__ import annotations

import ast
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


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("kvbridge", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
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
    return {name: edges.get(name, set()) for name in modules}


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
    """``from kvbridge.x import _name`` where ``_name`` is not a module: one module reaching into
    another's private names (a resource cut in two, STYLE.md point 6)."""
    modules = _modules()
    out = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("kvbridge"):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and f"{node.module}.{alias.name}" not in modules:
                        out.append(f"{name} takes {alias.name} from {node.module}")
    return sorted(out)


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
