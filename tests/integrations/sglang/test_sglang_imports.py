"""The SGLang integration's imports: one direction, public names only, and the
``get_kv_class`` re-pointing limited to SGLang's own modules."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvbridge

ROOT = Path(kvbridge.__file__).parent / "integrations" / "sglang"
PACKAGE = "kvbridge.integrations.sglang"


def _imports(path: Path) -> set[str]:
    """Every kvbridge module ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:  # from the package import a submodule
            out.update(f"{PACKAGE}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {name for name in out if name.startswith("kvbridge")}


# the public-API-only rule: tests/integrations/test_public_api_rule.py, for every integration


def test_no_import_circle_lazy_imports_included():
    graph = {p.stem: {n.rsplit(".", 1)[1] for n in _imports(p) if n.startswith(f"{PACKAGE}.")}
             for p in ROOT.glob("*.py")}  # fmt: skip
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"import circle: {' -> '.join((*path, node))}"
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, (*path, node))
        done.add(node)

    for node in sorted(graph):
        visit(node, ())
    assert graph["__init__"] == set()  # the package resolves its names lazily (importlib)
    assert "backend" in graph["patches"]  # the lazy import that closed the circle before
    assert "patches" not in graph["manager"] and "version" in graph["manager"]


def test_importing_the_package_imports_no_submodule():
    code = ("import sys, kvbridge.integrations.sglang as s\n"
            "subs = lambda: sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith(s.__name__ + '.'))\n"
            "print(subs()); print(s.BACKEND, s.SUPPORTED_VERSIONS[-1]); print(subs())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "kvbridge 0.5.23", "['patches', 'version']"]


@pytest.mark.sglang
def test_install_repoints_sglangs_modules_only():
    """A user's module that holds SGLang's own ``get_kv_class`` (imported before install) keeps
    it; SGLang's scheduler modules that imported it by name get the wrapper."""
    pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
    code = textwrap.dedent("""
        import sys, types
        from sglang.srt.disaggregation import decode, prefill, utils
        original = utils.get_kv_class
        mine = types.ModuleType("my_router_plugin")
        mine.get_kv_class = original
        mine.saved = {"f": original}
        sys.modules["my_router_plugin"] = mine
        from kvbridge.integrations.sglang import install
        install()
        print(mine.get_kv_class is original, mine.saved["f"] is original,
              prefill.get_kv_class is decode.get_kv_class is utils.get_kv_class is not original)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True", "True"]
